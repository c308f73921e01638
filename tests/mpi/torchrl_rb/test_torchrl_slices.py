# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
#
# gear_mpi: copied from pytorch/rl v0.14.0 (commit 373c31a85b30, test/rb/test_samplers.py, TestSamplers: the mask,
# padding and marker tests of SliceSampler); TorchRL's LICENSE (MIT) is
# the file LICENSE beside this one. Changed only to run on gear_mpi's classes: the names SliceSampler and LazyTensorStorage are
# bound to GearSliceSampler and GearStorage at import.
# What of the original file is not here, and why: tests/mpi/torchrl_rb/conftest.py.
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from torchrl.modules import GRUModule, set_recurrent_mode

# the storage and sampler the tests build by name are gear_mpi's
from gear_mpi.integrations import torchrl as gtrl

SliceSampler, LazyTensorStorage = gtrl.GearSliceSampler, gtrl.GearStorage


class TestSamplers:
    # ------------------------------------------------------------------
    # mask / lengths tests (strict_length=False)
    # ------------------------------------------------------------------

    def _make_rb_with_short_trajs(self, traj_lengths, slice_len, num_slices):
        """Helper: build a TensorDictReplayBuffer with trajectories of given lengths."""
        parts = []
        for t_id, length in enumerate(traj_lengths):
            is_init = torch.zeros(length, 1, dtype=torch.bool)
            is_init[0] = True  # episode reset at the first step of each trajectory
            parts.append(
                TensorDict(
                    {
                        "traj": torch.full((length,), t_id, dtype=torch.int),
                        "obs": torch.arange(length).float(),
                        "is_init": is_init,
                    },
                    batch_size=[length],
                )
            )
        data = torch.cat(parts)
        total = sum(traj_lengths)
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(total),
            sampler=SliceSampler(
                slice_len=slice_len,
                traj_key="traj",
                strict_length=False,
                pad_output=True,
            ),
            batch_size=num_slices * slice_len,
        )
        rb.extend(data)
        return rb

    def test_slice_sampler_mask_present_when_short_trajs(self):
        """mask appears in output when short trajectories force padding."""
        torch.manual_seed(0)
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[3, 6, 2], slice_len=5, num_slices=3
        )
        sample = rb.sample()
        assert ("collector", "mask") in sample.keys(True)

    def test_slice_sampler_mask_shape_dtype(self):
        """mask is bool with shape [B*T] (matches batch shape, no trailing 1)."""
        torch.manual_seed(0)
        B, T = 4, 6
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[2, 5, 3, 4], slice_len=T, num_slices=B
        )
        sample = rb.sample()
        mask = sample[("collector", "mask")]
        assert mask.shape == torch.Size([B * T])
        assert mask.dtype == torch.bool
        # mask must match the leading batch dim so trainer code can index
        # batch[batch.get(("collector", "mask"))] without broadcasting tricks.
        assert mask.shape[0] == sample.batch_size[0]

    def test_slice_sampler_mask_correctness(self):
        """mask rows are contiguous: True prefix followed by False suffix."""
        torch.manual_seed(0)
        B, T = 6, 8
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[3, 8, 2, 7, 1, 5], slice_len=T, num_slices=B
        )
        for _ in range(20):
            sample = rb.sample()
            mask = sample[("collector", "mask")].reshape(B, T)
            # derive lengths from the mask itself
            lengths = mask.sum(-1)  # [B]
            for i in range(B):
                length = lengths[i].item()
                assert length >= 1
                assert length <= T
                assert mask[
                    i, :length
                ].all(), f"slice {i}: first {length} steps should be True"
                assert not mask[
                    i, length:
                ].any(), f"slice {i}: steps after {length} should be False"

    def test_slice_sampler_mask_padded_obs_is_valid(self):
        """Padded positions repeat the last real index — obs values must be finite."""
        torch.manual_seed(0)
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[2, 6, 3], slice_len=5, num_slices=3
        )
        sample = rb.sample()
        assert torch.isfinite(sample["obs"]).all()

    def test_slice_sampler_strict_length_no_mask(self):
        """With pad_output=False, no mask is emitted regardless of strict_length."""
        torch.manual_seed(0)
        data = TensorDict(
            {
                "traj": torch.cat(
                    [torch.zeros(6, dtype=torch.int), torch.ones(6, dtype=torch.int)]
                ),
                "obs": torch.arange(12).float(),
            },
            batch_size=[12],
        )
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(12),
            sampler=SliceSampler(
                slice_len=4, traj_key="traj", strict_length=True, pad_output=False
            ),
            batch_size=8,
        )
        rb.extend(data)
        sample = rb.sample()
        assert ("collector", "mask") not in sample.keys(True)

    def test_slice_sampler_pad_output_strict_length_raises(self):
        """pad_output=True + strict_length=True is rejected at construction."""
        with pytest.raises(ValueError, match="pad_output=True is incompatible"):
            SliceSampler(
                slice_len=4, traj_key="traj", strict_length=True, pad_output=True
            )

    def test_slice_sampler_pad_output_marks_slice_starts(self):
        """pad_output=True writes is_init=True at every slice start.

        This is what lets a recurrent policy in `set_recurrent_mode("recurrent")`
        consume the flat [B*T] sample directly: the RNN splits on `is_init`
        and uses each slice's stored hidden state at position 0.
        """
        torch.manual_seed(0)
        B, T = 4, 8
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[3, 8, 2, 7, 1, 5], slice_len=T, num_slices=B
        )
        for _ in range(10):
            sample = rb.sample()
            is_init = sample["is_init"].reshape(B, T)
            # Position 0 of every slice must be True regardless of where the
            # slice landed within its source trajectory.
            assert is_init[:, 0].all(), "every slice must start with is_init=True"

    def test_slice_sampler_marks_slice_starts_no_pad(self):
        """Default (no pad_output) flow: is_init=True at every slice start.

        This is the workflow most users will hit: trajectories are written
        end-to-end into the buffer, the sampler returns concatenated
        variable-length slices, and the RNN splits on `is_init`. No mask, no
        padding involved.
        """
        torch.manual_seed(0)
        traj_lengths = [3, 8, 2, 7, 5]
        parts = []
        for t_id, length in enumerate(traj_lengths):
            init = torch.zeros(length, 1, dtype=torch.bool)
            init[0] = True
            parts.append(
                TensorDict(
                    {
                        "traj": torch.full((length,), t_id, dtype=torch.int),
                        "is_init": init,
                    },
                    batch_size=[length],
                )
            )
        data = torch.cat(parts)
        B = 4
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(data.numel()),
            sampler=SliceSampler(num_slices=B, traj_key="traj", strict_length=False),
            batch_size=B * 6,
        )
        rb.extend(data)
        for _ in range(10):
            sample = rb.sample()
            assert "is_init" in sample.keys(True)
            is_init = sample["is_init"].squeeze(-1)
            trunc = sample[("next", "truncated")].squeeze(-1)
            # Slice 0 always starts at position 0.
            assert is_init[0].item(), "first slice must start with is_init=True"
            # Every position right after a truncated flag must be is_init=True
            # (next slice's start). The last truncated marks the end of the
            # batch; nothing follows it.
            slice_ends = trunc.nonzero().squeeze(-1).tolist()
            for end in slice_ends[:-1]:
                assert is_init[
                    end + 1
                ].item(), f"slice starting at index {end + 1} missing is_init=True"

    def test_slice_sampler_pad_output_no_is_init_no_marker(self):
        """Without is_init in the storage we don't introduce one out of thin air."""
        torch.manual_seed(0)
        # Build a buffer *without* is_init.
        data = TensorDict(
            {
                "traj": torch.cat(
                    [
                        torch.full((3,), 0, dtype=torch.int),
                        torch.full((6,), 1, dtype=torch.int),
                        torch.full((2,), 2, dtype=torch.int),
                    ]
                ),
                "obs": torch.arange(11).float(),
            },
            batch_size=[11],
        )
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(11),
            sampler=SliceSampler(
                slice_len=5, traj_key="traj", strict_length=False, pad_output=True
            ),
            batch_size=15,
        )
        rb.extend(data)
        sample = rb.sample()
        # is_init must not appear if it wasn't in the storage
        assert "is_init" not in sample.keys(True)

    def test_slice_sampler_flat_sample_matches_batched_recurrent_module(self):
        """A flat padded sample must match an explicit [B, T] recurrent call."""
        torch.manual_seed(0)
        B, T = 4, 5
        input_size, hidden_size = 3, 7
        parts = []
        for traj_id, length in enumerate([11, 9, 10, 12]):
            is_init = torch.zeros(length, 1, dtype=torch.bool)
            is_init[0] = True
            parts.append(
                TensorDict(
                    {
                        "traj": torch.full((length,), traj_id, dtype=torch.int),
                        "embed": torch.randn(length, input_size),
                        "recurrent_state": torch.randn(length, 1, hidden_size),
                        "is_init": is_init,
                    },
                    batch_size=[length],
                )
            )
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(sum(part.shape[0] for part in parts)),
            sampler=SliceSampler(
                slice_len=T,
                traj_key="traj",
                strict_length=False,
                pad_output=True,
            ),
            batch_size=B * T,
        )
        rb.extend(torch.cat(parts))
        sample = rb.sample()
        assert sample["is_init"].reshape(B, T)[:, 0].all()

        gru = GRUModule(
            input_size=input_size,
            hidden_size=hidden_size,
            num_layers=1,
            in_keys=["embed", "recurrent_state", "is_init"],
            out_keys=["features", ("next", "recurrent_state")],
        )
        with set_recurrent_mode("recurrent"):
            flat_out = gru(sample.clone())
            batched_out = gru(sample.clone().reshape(B, T))

        torch.testing.assert_close(
            flat_out["features"].reshape(B, T, hidden_size), batched_out["features"]
        )
        torch.testing.assert_close(
            flat_out[("next", "recurrent_state")].reshape(B, T, 1, hidden_size),
            batched_out[("next", "recurrent_state")],
        )

    def test_slice_sampler_mask_all_long_trajs_no_mask(self):
        """When all trajs >= slice_len, pad_output=True still emits no mask (nothing to pad)."""
        torch.manual_seed(0)
        data = TensorDict(
            {
                "traj": torch.cat(
                    [torch.zeros(8, dtype=torch.int), torch.ones(8, dtype=torch.int)]
                ),
                "obs": torch.arange(16).float(),
            },
            batch_size=[16],
        )
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(16),
            sampler=SliceSampler(
                slice_len=4, traj_key="traj", strict_length=False, pad_output=True
            ),
            batch_size=8,
        )
        rb.extend(data)
        sample = rb.sample()
        # No short trajectories → no padding needed → no mask emitted
        assert ("collector", "mask") not in sample.keys(True)

    def test_slice_sampler_truncated_marks_last_real_step(self):
        """truncated flag should sit at the last *real* timestep, not the padded end."""
        torch.manual_seed(0)
        B, T = 4, 6
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[2, 5, 3, 4], slice_len=T, num_slices=B
        )
        sample = rb.sample()
        mask = sample[("collector", "mask")].reshape(B, T)
        lengths = mask.sum(-1)  # [B] — derived from mask
        trunc = sample[("next", "truncated")].reshape(B, T)
        for i in range(B):
            length = lengths[i].item()
            # truncated should be True exactly at position length-1
            assert trunc[
                i, length - 1
            ].item(), f"slice {i}: truncated missing at last real step"
            # no truncated flag in padded region
            if length < T:
                assert not trunc[
                    i, length:
                ].any(), f"slice {i}: spurious truncated in padding"
