"""Compressed columns (gm.Compressed): the declaration, a Shard's exact windows against an uncompressed twin,
incompressible data, corrupted chunks, shm and file memory; and the multi-rank module
tests/mpi/test_compressed.py on 1 and 2 ranks (twin Replays, checkpoints exact and resharded, a corrupted
checkpoint)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import compressed as compressed_module
from mpi_util import run_pytest_mpi

COLUMNS = {"pixels": ((6, 5), "uint8"), "r": ((), "float32")}


def twins(chunk, capacity=40, dtype="uint8", level=1, **kw):
    cols = dict(COLUMNS, pixels=((6, 5), dtype))
    comp = dict(cols, pixels=((6, 5), dtype, gm.Compressed(level=level, chunk=chunk)))
    a = gm.Shard(gm.TrajectorySpec(cols, max_length=9), capacity, seed=3, tag=1, **kw)
    b = gm.Shard(gm.TrajectorySpec(comp, max_length=9), capacity, seed=3, tag=1, **kw)
    return a, b


def random_trajectory(rng, dtype="uint8", dense=False):
    length = int(rng.integers(1, 10))
    if dense:
        pixels = rng.integers(0, 256, (length, 6, 5)).astype(dtype)
    else:
        pixels = ((rng.random((length, 6, 5)) < 0.2) * rng.integers(0, 9, (length, 6, 5))).astype(dtype)
    return {"pixels": pixels, "r": rng.random(length).astype(np.float32)}


def test_declaration_equality_and_serialization():
    c = gm.Compressed(level=3, codec="lz4", chunk=8)
    spec = gm.TrajectorySpec({"pixels": ((84, 84), "uint8", c), "a": (1, "int64")}, max_length=5)
    assert spec["pixels"].compression == c and spec["a"].compression is None
    assert spec.compressed == ("pixels",)
    assert gm.TrajectorySpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["columns"]["a"] == [[1], "<i8"]  # uncompressed entries keep the old form
    plain = gm.TrajectorySpec({"pixels": ((84, 84), "uint8"), "a": (1, "int64")}, max_length=5)
    assert plain != spec and "Compressed(level=3" in repr(spec)
    assert gm.TrajectorySpec({"pixels": ((84, 84), "uint8", None)}, 5) == gm.TrajectorySpec({"pixels": ((84, 84), "uint8")}, 5)
    assert gm.Compressed().steps_per_chunk(84 * 84, 10 ** 6) == 4  # about 32 KiB of raw steps
    assert gm.Compressed(chunk=100).steps_per_chunk(4, 30) == 30
    for bad in (dict(level=10), dict(level=-1), dict(codec="snappy"), dict(chunk=0), dict(level=True)):
        with pytest.raises(ValueError, match="Compressed"):
            gm.Compressed(**bad)
    with pytest.raises(ValueError, match="Compressed"):
        gm.TrajectorySpec({"pixels": ((2,), "uint8", "zstd")}, 5)


@pytest.mark.parametrize("chunk,kernels", [(None, True), (1, True), (3, True), (7, True), (40, True), (3, False),
                                           (None, False)])
def test_shard_windows_match_an_uncompressed_twin(monkeypatch, chunk, kernels):
    """Batches (every align, windows across chunk and ring boundaries, rings wrapping) and get() are identical,
    decoded by the compiled kernels or by the Python path."""
    monkeypatch.setattr(compressed_module, "USE_KERNELS", kernels)
    rng = np.random.default_rng(chunk or 0)
    a, b = twins(chunk)
    for it in range(40):
        traj = random_trajectory(rng)
        a.insert(traj), b.insert(traj)
        if it == 20:  # a packed insert larger than several chunks
            many = [random_trajectory(rng) for _ in range(4)]
            a.insert_many(many), b.insert_many(many)
        for align, window in (("random", 4), ("head", 9), ("tail", 3)):
            x, y = a.sample(8, window, align), b.sample(8, window, align)
            for name in COLUMNS:
                assert np.array_equal(x[name].numpy(), y[name].numpy()), (it, name, align)
            assert np.array_equal(x.keys.numpy(), y.keys.numpy())
    out = b.sample(8, 4)  # a reused batch: padding rows are rewritten with zeros
    a.sample(8, 4)  # the twin's stream kept in step
    out["pixels"].numpy()[:] = 77
    y = b.sample(8, 4, out=out)
    x = a.sample(8, 4)
    assert np.array_equal(x["pixels"].numpy(), y["pixels"].numpy())
    for key in a.live_keys().tolist():
        got, want = b.get(key), a.get(key)
        assert all(np.array_equal(got[n], want[n]) for n in COLUMNS)
    assert "pixels" not in b.columns() and "r" in b.columns()
    ring = b.store.compressed["pixels"]  # at most blosc2's frame overhead a chunk more than raw, plus the open chunk
    assert b.stored_bytes() <= a.stored_bytes() + ring.n_chunks * 64 + ring.chunk_bytes
    b.clear()
    assert len(b) == 0 and b.store.compressed["pixels"].stored_bytes == 0
    b.insert(random_trajectory(rng))
    assert b.sample(2, 4)["pixels"].shape == (2, 4, 6, 5)


def test_kernel_checksum_equals_zlib_and_large_batches_match_the_python_path(monkeypatch):
    """The kernels' CRC-32 is zlib's; a batch large enough for the parallel decode and copy equals the Python
    path's, byte for byte (frames of 84x84, chunks of 2 steps, windows wrapping the ring)."""
    import zlib

    from gear_mpi.kernels import chunks as chunk_kernels
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 300):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        got = chunk_kernels.crc32_at(np.frombuffer(data + b"x", np.uint8).ctypes.data, n, chunk_kernels.CRC_TABLE)
        assert int(got) == zlib.crc32(data)
    spec = gm.TrajectorySpec({"f": ((84, 84), "uint8", gm.Compressed(chunk=2))}, max_length=30)
    shard = gm.Shard(spec, 200, seed=1)
    for _ in range(30):  # the ring wraps several times; the last chunk stays open
        length = int(rng.integers(3, 30))
        shard.insert({"f": ((rng.random((length, 84, 84)) < 0.1) * rng.integers(1, 255)).astype(np.uint8)})
    ring = shard.store.compressed["f"]
    starts = rng.integers(0, 200, 256)
    n_valid = rng.integers(0, 9, 256)
    pad = np.minimum(rng.integers(0, 3, 256), 8 - n_valid)
    rows = rng.permutation(256)
    outs = []
    for kernels in (True, False):
        monkeypatch.setattr(compressed_module, "USE_KERNELS", kernels)
        out = np.full(256 * 8 * ring.sb, 7, np.uint8)
        ring.gather(starts, n_valid, pad, rows, out, 8)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    if compressed_module._decoder(compressed_module.codec_library()) is None:  # (a library of another layout)
        pytest.skip(f"the compiled reads do not decode here: {compressed_module.decoder_refusal()}")
    with pytest.raises(ValueError, match="outside the ring"):
        monkeypatch.setattr(compressed_module, "USE_KERNELS", True)
        ring.gather(np.array([0]), np.array([9]), np.array([0]), np.array([0]), outs[0], 8)


def test_incompressible_data_stays_exact_and_bounded():
    """Random bytes (and float64 noise) do not compress: still exact, at most the codec's frame overhead more."""
    rng = np.random.default_rng(5)
    for dtype in ("uint8", "float64"):
        a, b = twins(4, capacity=64, dtype=dtype)
        for _ in range(30):
            traj = random_trajectory(rng, dtype, dense=True)
            if dtype == "float64":
                traj["pixels"] = rng.standard_normal(traj["pixels"].shape)
            a.insert(traj), b.insert(traj)
        x, y = a.sample(16, 5), b.sample(16, 5)
        assert np.array_equal(x["pixels"].numpy(), y["pixels"].numpy())
        ring = b.store.compressed["pixels"]
        sealed = sum(c is not None for c in ring.chunks)
        assert ring.stored_bytes <= sealed * (ring.chunk_bytes + 64), (ring.stored_bytes, sealed)


def flip_byte(data: bytes, at: int) -> None:
    """Flip one bit of ``data`` in place (bit rot in the memory holding a sealed chunk)."""
    byte = ctypes.c_uint8.from_address(np.frombuffer(data, np.uint8).ctypes.data + at)
    byte.value ^= 0x10


@pytest.mark.parametrize("kernels", [True, False])
def test_corrupted_chunk_raises_naming_column_and_trajectory(monkeypatch, kernels):
    monkeypatch.setattr(compressed_module, "USE_KERNELS", kernels)
    rng = np.random.default_rng(2)
    _, b = twins(3)
    for _ in range(6):
        b.insert(random_trajectory(rng))
    ring = b.store.compressed["pixels"]
    j = next(i for i, c in enumerate(ring.chunks) if c is not None)
    flip_byte(ring.chunks[j], len(ring.chunks[j]) // 2)
    key = next(k for k in b.live_keys().tolist() if b.locate([k])[0][0] < 3)  # a trajectory starting in chunk 0
    with pytest.raises(gm.CorruptDataError, match=rf"column 'pixels': trajectory key {key} reads compressed chunk "
                                                  rf"{j} \(ring steps 0\.\.2\).*CRC-32"):
        b.get(key)
    with pytest.raises(gm.CorruptDataError, match=r"column 'pixels': trajectory key \d+ reads compressed chunk"):
        for _ in range(50):
            b.sample(8, 9, "head")


def test_shm_and_file_memory_take_compressed_columns(tmp_path):
    """shm: the raw columns in shared memory, the chunks in this process; file (tests/test_compressed_memory.py
    has the rest): the chunks in a file of the shard's."""
    spec = gm.TrajectorySpec({"pixels": ((4,), "uint8", gm.Compressed())}, max_length=3)
    with gm.Shard(spec, 10, memory="file", path=str(tmp_path)) as s:
        s.insert({"pixels": np.arange(12, dtype=np.uint8).reshape(3, 4)})
        assert np.array_equal(s.sample(1, 3, "head")["pixels"].numpy()[0], np.arange(12).reshape(3, 4))
    assert list(tmp_path.iterdir()) == []
    with gm.Shard(spec, 10, memory="shm") as s:  # raw columns in shared memory; the chunks in this process
        s.insert({"pixels": np.arange(12, dtype=np.uint8).reshape(3, 4)})
        assert np.array_equal(s.sample(1, 3, "head")["pixels"].numpy()[0], np.arange(12).reshape(3, 4))


def test_replays_on_one_and_two_ranks(tmp_path):
    """tests/mpi/test_compressed.py: twins on 1 rank (an MPI singleton) and 2; a 2-rank save resharded onto 1."""
    run_pytest_mpi(1, "test_compressed.py", mpiexec=False, timeout=300)
    run = run_pytest_mpi(2, "test_compressed.py", env={"GEAR_TEST_COMPRESSED_SAVE": str(tmp_path)}, timeout=300)
    assert any("test_save_twins_for_a_resharded_load" in t for t in run.passed(0)), run.passed(0)
    run = run_pytest_mpi(1, "test_compressed.py::test_load_twins_resharded", mpiexec=False, timeout=300,
                         env={"GEAR_TEST_COMPRESSED_LOAD": str(tmp_path)})
    assert any("test_load_twins_resharded" in t for t in run.passed(0)), run.passed(0)


@pytest.mark.parametrize("chunk,kernels,pad", [(None, True, "first"), (3, True, "first"), (1, True, "zeros"),
                                               (3, False, "first"), (2, False, "zeros")])
def test_frame_stacks_over_a_compressed_frame_column_match_an_uncompressed_twin(monkeypatch, chunk, kernels, pad):
    """Frames stored once and compressed: FrameStack / NextStep rebuilt from the decoded chunks (kernels) or
    from decompressed context windows (Python path) give exactly what the same spec with a raw frame column
    gives, episode starts and ring wrap included; a second compressed column (not a source) too."""
    monkeypatch.setattr(compressed_module, "USE_KERNELS", kernels)

    def spec(compressed):
        frame = ((6, 5), "uint8", gm.Compressed(chunk=chunk)) if compressed else ((6, 5), "uint8")
        action = ((), "int64", gm.Compressed(chunk=4)) if compressed else ((), "int64")
        return gm.TrajectorySpec({"frame": frame, "action": action, "obs": gm.FrameStack("frame", 4, pad=pad),
                                  "next_obs": gm.NextStep("obs")}, max_length=12)
    raw, comp = gm.Shard(spec(False), 50, seed=7, tag=1), gm.Shard(spec(True), 50, seed=7, tag=1)
    rng = np.random.default_rng(5)
    try:
        for i in range(14):  # about 100 steps through a 50-step ring: wraps, evicts
            n = int(rng.integers(2, 12))
            ep = {"frame": rng.integers(0, 256, (n, 6, 5)).astype(np.uint8), "action": np.arange(n, dtype=np.int64)}
            assert raw.insert(ep, 1.0) == comp.insert(ep, 1.0)
            for window, align in ((1, "random"), (3, "head"), (2, "tail")):
                a, b = raw.sample(8, window, align), comp.sample(8, window, align)
                for name in ("frame", "action", "obs", "next_obs"):
                    np.testing.assert_array_equal(a[name].numpy(), b[name].numpy(), err_msg=f"{name} {i}")
                np.testing.assert_array_equal(a.keys.numpy(), b.keys.numpy())
                np.testing.assert_array_equal(a.mask.numpy(), b.mask.numpy())
    finally:
        raw.close()
        comp.close()


@pytest.mark.parametrize("kernels", [True, False])
def test_corrupted_frame_chunk_raises_when_stacks_are_rebuilt(monkeypatch, kernels):
    """A flipped byte in a compressed frame column read for frame stacks: CorruptDataError naming the column
    and a trajectory key, never wrong stacks."""
    monkeypatch.setattr(compressed_module, "USE_KERNELS", kernels)
    spec = gm.TrajectorySpec({"frame": ((6, 5), "uint8", gm.Compressed(chunk=2)), "obs": gm.FrameStack("frame", 4),
                              "next_obs": gm.NextStep("obs")}, max_length=12)
    shard = gm.Shard(spec, 60, seed=1)
    rng = np.random.default_rng(3)
    for _ in range(4):
        shard.insert({"frame": rng.integers(0, 256, (10, 6, 5)).astype(np.uint8)})
    ring = shard.store.compressed["frame"]
    for j in range(0, 20):  # every chunk of the first 40 steps
        flip_byte(ring.chunks[j], 5)
    with pytest.raises(gm.CorruptDataError, match=r"column 'frame': trajectory key \d+ reads compressed chunk"):
        for _ in range(20):
            shard.sample(8, 2)
    shard.close()


def test_saved_chunks_of_another_default_size_load_as_they_are(monkeypatch):
    """A ring saved when ``chunk=None`` meant 64 KiB chunks (8 frames) restores into a new ring (4 frames by
    default now) without recompression: same bytes, same reads; a pinned ``chunk`` still refuses it."""
    from gear_mpi import spec as spec_module
    CompressedRing = compressed_module.CompressedRing
    col = gm.TrajectorySpec({"f": ((84, 84), "uint8", gm.Compressed())}, 5)["f"]
    rng = np.random.default_rng(0)
    data = ((rng.random((50, 84, 84)) < 0.05) * 200).astype(np.uint8)
    monkeypatch.setattr(spec_module, "CHUNK_BYTES", 64 << 10)
    old = CompressedRing(col, 64)
    monkeypatch.undo()
    old.write(0, data)
    new = CompressedRing(col, 64)
    assert (old.k, new.k) == (8, 4)
    new.restore(old.export())
    assert new.k == 8 and new.stored_bytes == old.stored_bytes
    assert np.array_equal(new.read_steps(np.arange(50)), data)
    pinned = CompressedRing(gm.TrajectorySpec({"f": ((84, 84), "uint8", gm.Compressed(chunk=4))}, 5)["f"], 64)
    with pytest.raises(ValueError, match="do not fit"):
        pinned.restore(old.export())
    assert pinned.k == 4 and pinned.stored_bytes == 0


def test_a_library_is_called_by_address_only_where_its_declarations_were_checked():
    """A listed version is taken whatever its header; another version where its wheel's blosc2.h declares the
    parameters' structure and the four calls as the checked headers do (comments and spacing aside), refused
    where it has no header or declares any of them otherwise, the reason naming the version and the declaration."""
    refusal = compressed_module.library_refusal
    checked = "\n".join(compressed_module.CHECKED_DECLARATIONS)
    spaced = checked.replace("(", " ( ").replace("*", " * ").replace("; ", ";\n  /* a field */ ")
    assert refusal("3.6.1", None) is None and refusal("3.8.0", "") is None
    assert refusal("9.9.0", checked) is None and refusal("9.9.0", "// head\n" + spaced + "\n// tail") is None
    assert "no blosc2.h" in refusal("9.9.0", None) and "9.9.0" in refusal("9.9.0", None)
    assert "(unknown version)" in refusal("", None)
    for old, new, name in [("int16_t nthreads", "int32_t nthreads", "blosc2_dparams"),
                           ("int32_t typesize; }", "int32_t typesize; int32_t extra; }", "blosc2_dparams"),
                           ("int32_t destsize", "int64_t destsize", "blosc2_decompress_ctx"),
                           ("blosc2_dparams dparams", "const blosc2_dparams *dparams", "blosc2_create_dctx"),
                           ("blosc2_get_blosc2_dparams_defaults(void)", "blosc2_get_dparams_defaults(void)",
                            "blosc2_get_blosc2_dparams_defaults"),
                           ("void blosc2_init(void)", "int blosc2_init(void)", "blosc2_init")]:
        assert old in checked
        why = refusal("9.9.0", checked.replace(old, new))
        assert why is not None and why.endswith(f"declares {name} otherwise"), (old, why)


def test_the_installed_codec_library_decodes_in_the_kernels_when_checked(monkeypatch):
    """The python-blosc2 installed here: where its bundled library passes the check, the kernels' decoder loads
    (one context per numba thread); where it does not, the decoder is refused with that reason."""
    blosc2 = compressed_module.codec_library()
    monkeypatch.setattr(compressed_module, "_decoder_state", [])
    why = compressed_module.installed_refusal(blosc2)
    dec = compressed_module._decoder(blosc2)
    if why is None:
        assert dec is not None and dec.contexts.all() and dec.function != 0, compressed_module.decoder_refusal()
        assert compressed_module.decoder_refusal() is None
    else:
        assert dec is None and compressed_module.decoder_refusal() == why


def test_an_unchecked_codec_library_keeps_the_python_path(monkeypatch):
    """A bundled C-blosc2 whose structure layout was not checked is never called by address: the decoder is
    refused with a reason, and sampling stays exact through the Python path."""
    blosc2 = compressed_module.codec_library()
    monkeypatch.setattr(compressed_module, "_decoder_state", [])
    monkeypatch.setattr(blosc2, "blosclib_version", "9.9.0 ($Date:: 2099-01-01 #$)", raising=False)
    header = compressed_module._library_header(blosc2) or ""
    monkeypatch.setattr(compressed_module, "_library_header",
                        lambda _: header.replace("int32_t typesize;", "int64_t typesize;"))
    assert compressed_module._decoder(blosc2) is None
    assert "9.9.0 is not one whose structures were checked" in compressed_module.decoder_refusal()
    with pytest.raises(OSError, match="9.9.0 is not one whose structures were checked"):
        compressed_module._Decoder(blosc2)
    rng = np.random.default_rng(3)
    a, b = twins(None)
    for _ in range(12):
        traj = random_trajectory(rng)
        a.insert(traj), b.insert(traj)
    x, y = a.sample(8, 4), b.sample(8, 4)
    for name in COLUMNS:
        assert np.array_equal(x[name].numpy(), y[name].numpy()), name


@pytest.mark.parametrize("ring,codec", [(60, "zstd"), (4000, "lz4")])
def test_stacks_of_large_batches_match_the_raw_twin_with_and_without_shared_chunks(ring, codec):
    """84x84 frames, batches of 256 (the parallel kernel): frame stacks, next steps and the frame column itself
    equal the raw twin's, in a 60-step ring (every chunk shared by many windows, kept in a thread's rows)
    and a 4000-step one (few shared), episode starts, ring wrap and windows of 1 and 3 included."""
    def spec(compressed):
        frame = ((84, 84), "uint8", gm.Compressed(codec=codec)) if compressed else ((84, 84), "uint8")
        return gm.TrajectorySpec({"frame": frame, "obs": gm.FrameStack("frame", 4), "next_obs": gm.NextStep("obs")},
                                 max_length=40)
    raw, comp = gm.Shard(spec(False), ring, seed=4, tag=1), gm.Shard(spec(True), ring, seed=4, tag=1)
    rng = np.random.default_rng(9)
    try:
        for _ in range(3 * ring // 20 + 2):  # about three laps of the ring
            n = int(rng.integers(3, 40))
            ep = {"frame": ((rng.random((n, 84, 84)) < 0.05) * rng.integers(1, 255, (n, 1, 1))).astype(np.uint8)}
            assert raw.insert(ep) == comp.insert(ep)
        for window in (1, 3):
            a, b = raw.sample(256, window), comp.sample(256, window)
            for name in ("frame", "obs", "next_obs"):
                np.testing.assert_array_equal(a[name].numpy(), b[name].numpy(), err_msg=f"{name} W={window}")
            np.testing.assert_array_equal(a.mask.numpy(), b.mask.numpy())
    finally:
        raw.close()
        comp.close()
