"""Stable-Baselines3's own ReplayBuffer tests (tests/test_buffers.py), run on gear_mpi's SB3 buffers.

Copied from Stable-Baselines3 (https://github.com/DLR-RM/stable-baselines3, commit e05d2dbe, version
2.9.0a4 in its tree, whose stable_baselines3/common/buffers.py is identical to the installed 2.9.2's),
under its MIT licence, reproduced below. Changed only to parametrize gear_mpi's classes in:

- ``test_replay_buffer_normalization``: ``(replay_buffer_cls, use_dict)`` pairs: SB3's ``ReplayBuffer`` and
  ``DictReplayBuffer`` (kept as the reference), then ``GearReplayBuffer`` and ``GearPrioritizedReplayBuffer``
  on the array environment and on the Dict one (instead of ``[ReplayBuffer, DictReplayBuffer]``; gear_mpi's
  classes take both kinds of space, so the environment is chosen by ``use_dict`` rather than by the class);
- ``test_device_buffer``: the same pairs (instead of SB3's four buffer classes);
- ``test_buffer_dtypes``: a ``replay_buffer_cls`` parameter takes the place of ``ReplayBuffer`` (the
  dtype checks of ``RolloutBuffer`` stay, untouched); its ``use_dict=True`` cases build SB3's
  ``DictReplayBuffer`` for the ``ReplayBuffer`` parameter and gear_mpi's class on the Dict space otherwise.

Not run, and why: ``test_env`` checks the dummy environments, not a buffer; the ``RolloutBuffer`` and
``DictRolloutBuffer`` cases test SB3's on-policy buffers; ``test_custom_rollout_buffer`` is about on-policy
rollout buffers.

--- Stable-Baselines3's licence ---

The MIT License

Copyright (c) 2019 Antonin Raffin

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in
all copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN
THE SOFTWARE.
"""
import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces

from stable_baselines3.common.buffers import DictReplayBuffer, DictRolloutBuffer, ReplayBuffer, RolloutBuffer
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.utils import get_device
from stable_baselines3.common.vec_env import VecNormalize

from gear_mpi.integrations.sb3 import GearPrioritizedReplayBuffer, GearReplayBuffer

GEAR_BUFFERS = (GearReplayBuffer, GearPrioritizedReplayBuffer)


class DummyEnv(gym.Env):
    """
    Custom gym environment for testing purposes
    """

    def __init__(self):
        self.action_space = spaces.Box(1, 5, (1,))
        self.observation_space = spaces.Box(1, 5, (1,))
        self._observations = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]], dtype=np.float32)
        self._rewards = [1, 2, 3, 4, 5]
        self._t = 0
        self._ep_length = 100

    def reset(self, *, seed=None, options=None):
        self._t = 0
        obs = self._observations[0]
        return obs, {}

    def step(self, action):
        self._t += 1
        index = self._t % len(self._observations)
        obs = self._observations[index]
        terminated = False
        truncated = self._t >= self._ep_length
        reward = self._rewards[index]
        return obs, reward, terminated, truncated, {}


class DummyDictEnv(gym.Env):
    """
    Custom gym environment for testing purposes
    """

    def __init__(self):
        # Test for multi-dim action space
        self.action_space = spaces.Box(1, 5, shape=(10, 7))
        space = spaces.Box(1, 5, (1,))
        self.observation_space = spaces.Dict({"observation": space, "achieved_goal": space, "desired_goal": space})
        self._observations = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]], dtype=np.float32)
        self._rewards = [1, 2, 3, 4, 5]
        self._t = 0
        self._ep_length = 100

    def reset(self, seed=None, options=None):
        self._t = 0
        obs = {key: self._observations[0] for key in self.observation_space.spaces.keys()}
        return obs, {}

    def step(self, action):
        self._t += 1
        index = self._t % len(self._observations)
        obs = {key: self._observations[index] for key in self.observation_space.spaces.keys()}
        terminated = False
        truncated = self._t >= self._ep_length
        reward = self._rewards[index]
        return obs, reward, terminated, truncated, {}


BUFFER_CASES = [(ReplayBuffer, False), (DictReplayBuffer, True), *[(c, d) for c in GEAR_BUFFERS for d in (False, True)]]


@pytest.mark.parametrize("replay_buffer_cls,use_dict", BUFFER_CASES)
def test_replay_buffer_normalization(replay_buffer_cls, use_dict):
    env = DummyDictEnv if use_dict else DummyEnv
    env = make_vec_env(env)
    env = VecNormalize(env)

    buffer = replay_buffer_cls(100, env.observation_space, env.action_space, device="cpu")

    # Interact and store transitions
    env.reset()
    obs = env.get_original_obs()
    for _ in range(100):
        action = env.action_space.sample()
        _, _, done, info = env.step(action)
        next_obs = env.get_original_obs()
        reward = env.get_original_reward()
        buffer.add(obs, next_obs, action, reward, done, info)
        obs = next_obs

    sample = buffer.sample(50, env)
    # Test observation normalization
    for observations in [sample.observations, sample.next_observations]:
        if isinstance(sample, DictReplayBufferSamples):
            for key in observations.keys():
                assert th.allclose(observations[key].mean(0), th.zeros(1), atol=1)
        elif isinstance(sample, ReplayBufferSamples):
            assert th.allclose(observations.mean(0), th.zeros(1), atol=1)
    # Test reward normalization
    assert np.allclose(sample.rewards.mean(0), np.zeros(1), atol=1)


@pytest.mark.parametrize("replay_buffer_cls,use_dict", BUFFER_CASES)
@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
def test_device_buffer(replay_buffer_cls, use_dict, device):
    if device == "cuda" and not th.cuda.is_available():
        pytest.skip("CUDA not available")

    env = DummyDictEnv if use_dict else DummyEnv
    env = make_vec_env(env)

    buffer = replay_buffer_cls(100, env.observation_space, env.action_space, device=device)

    # Interact and store transitions
    obs = env.reset()
    for _ in range(100):
        action = env.action_space.sample()
        next_obs, reward, done, info = env.step(action)
        if replay_buffer_cls in [RolloutBuffer, DictRolloutBuffer]:
            episode_start, values, log_prob = np.zeros(1), th.zeros(1), th.ones(1)
            buffer.add(obs, action, reward, episode_start, values, log_prob)
        else:
            buffer.add(obs, next_obs, action, reward, done, info)
        obs = next_obs

    # Get data from the buffer
    if replay_buffer_cls in [RolloutBuffer, DictRolloutBuffer]:
        # get returns an iterator over minibatches
        data = buffer.get(50)
    elif replay_buffer_cls in [ReplayBuffer, DictReplayBuffer, *GEAR_BUFFERS]:
        data = [buffer.sample(50)]

    # Check that all data are on the desired device
    desired_device = get_device(device).type
    for minibatch in list(data):
        for value in minibatch:
            if isinstance(value, dict):
                for key in value.keys():
                    assert value[key].device.type == desired_device
            elif isinstance(value, th.Tensor):
                assert value.device.type == desired_device
            elif isinstance(value, np.ndarray):
                # For prioritized replay weights/indices
                pass
            elif value is None:
                # discounts factors are only set for n-step replay buffer
                pass
            else:
                raise TypeError(f"Unknown value type: {type(value)}")


@pytest.mark.parametrize(
    "obs_dtype",
    [
        np.dtype(np.uint8),
        np.dtype(np.int8),
        np.dtype(np.uint16),
        np.dtype(np.int16),
        np.dtype(np.uint32),
        np.dtype(np.int32),
        np.dtype(np.uint64),
        np.dtype(np.int64),
        np.dtype(np.float16),
        np.dtype(np.float32),
        np.dtype(np.float64),
    ],
)
@pytest.mark.parametrize("use_dict", [False, True])
@pytest.mark.parametrize(
    "action_space",
    [
        spaces.Discrete(10),
        spaces.Box(low=-1.0, high=1.0, dtype=np.float32),
        spaces.Box(low=-1.0, high=1.0, dtype=np.float64),
    ],
)
@pytest.mark.parametrize("replay_buffer_cls", [ReplayBuffer, *GEAR_BUFFERS])
def test_buffer_dtypes(obs_dtype, use_dict, action_space, replay_buffer_cls):
    obs_space = spaces.Box(0, 100, dtype=obs_dtype)
    buffer_params = dict(buffer_size=1, action_space=action_space)
    # For off-policy algorithms, we cast float64 actions to float32, see GH#1145
    actual_replay_action_dtype = ReplayBuffer._maybe_cast_dtype(action_space.dtype)
    # For on-policy, we cast at sample time to float32 for backward compat
    # and to avoid issue computing log prob with multibinary
    actual_rollout_action_dtype = np.float32

    if use_dict:
        dict_obs_space = spaces.Dict({"obs": obs_space, "obs_2": spaces.Box(0, 100, dtype=np.uint8)})
        buffer_params["observation_space"] = dict_obs_space
        rollout_buffer = DictRolloutBuffer(**buffer_params)
        replay_buffer = (DictReplayBuffer if replay_buffer_cls is ReplayBuffer else replay_buffer_cls)(**buffer_params)
        assert rollout_buffer.observations["obs"].dtype == obs_dtype
        assert replay_buffer.observations["obs"].dtype == obs_dtype
        assert rollout_buffer.observations["obs_2"].dtype == np.uint8
        assert replay_buffer.observations["obs_2"].dtype == np.uint8
    else:
        buffer_params["observation_space"] = obs_space
        rollout_buffer = RolloutBuffer(**buffer_params)
        replay_buffer = replay_buffer_cls(**buffer_params)
        assert rollout_buffer.observations.dtype == obs_dtype
        assert replay_buffer.observations.dtype == obs_dtype

    assert rollout_buffer.actions.dtype == action_space.dtype
    assert replay_buffer.actions.dtype == actual_replay_action_dtype
    # Check that sampled types are corrects
    rollout_buffer.full = True
    replay_buffer.full = True
    rollout_data = next(rollout_buffer.get(batch_size=64))
    buffer_data = replay_buffer.sample(batch_size=64)
    assert rollout_data.actions.numpy().dtype == actual_rollout_action_dtype
    assert buffer_data.actions.numpy().dtype == actual_replay_action_dtype
    if use_dict:
        assert buffer_data.observations["obs"].numpy().dtype == obs_dtype
        assert buffer_data.observations["obs_2"].numpy().dtype == np.uint8
        assert rollout_data.observations["obs"].numpy().dtype == obs_dtype
        assert rollout_data.observations["obs_2"].numpy().dtype == np.uint8
    else:
        assert buffer_data.observations.numpy().dtype == obs_dtype
        assert rollout_data.observations.numpy().dtype == obs_dtype
