"""leantune.data.video_vae against diffusers' real AutoencoderKLWan (tiny configs, CPU).

Parity is bit for bit (torch.equal), in fp32 and in bf16: the streamed loop runs the VAE's own modules on the same
chunks in the same order as `_encode` / `_decode`. Memory is measured as the bytes of tensor
storage alive, tracked op by op through a TorchDispatchMode (torch's CPU allocator is invisible to
tracemalloc), with the clip decoded from a real file inside the measured region in both cases.
"""
import weakref
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from leantune.data import video, video_vae

W, H = 32, 32
Z = 4
LONG = 25               # frames of the long clip: about 3x the short one's 9 (and a 4k+1)


def tiny_vae(wan22: bool = False) -> AutoencoderKLWan:
    """Wan 2.1's layout (8x spatial in the real one, 4x here) or Wan 2.2's (residual, 2x2 patches)."""
    torch.manual_seed(0)
    extra = dict(is_residual=True, patch_size=2, in_channels=12, out_channels=12, decoder_base_dim=12) if wan22 else {}
    return AutoencoderKLWan(base_dim=8, z_dim=Z, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0],
                            scale_factor_spatial=4, **extra).eval()


def pattern(i: int) -> np.ndarray:
    """Frame i: a moving colour gradient, so every chunk differs and the causal cache matters."""
    y, x = np.mgrid[0:H, 0:W]
    r = (x * 7 + i * 11) % 256
    g = (y * 5 + i * 3) % 256
    b = ((x + y) * 3 + i * 17) % 256
    return np.stack([r, g, b], -1).astype(np.uint8)


def write_clip(path, n, fps=16):
    with av.open(str(path), "w") as out:
        s = out.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.codec_context.time_base = Fraction(1, fps)
        for i in range(n):
            f = av.VideoFrame.from_ndarray(pattern(i), format="rgb24")
            f.pts, f.time_base = i, Fraction(1, fps)
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("vae_clips")
    return write_clip(d / "short.mp4", 9), write_clip(d / "long.mp4", LONG)


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive, over every op run inside it (parameters excluded).

    Each op's outputs are tracked by their storage; a storage counts until the last tracked tensor
    on it is collected. Views share their base's storage, so a slice is not counted twice.
    """

    def __init__(self):
        super().__init__()
        self.refs: dict[int, list[int]] = {}        # storage address -> [tracked tensors, bytes]
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or storage.nbytes() == 0:
            return
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [0, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wan22", [False, True], ids=["wan2.1-layout", "wan2.2-layout"])
def test_streamed_encode_and_decode_equal_the_whole_clip_calls_bit_for_bit(wan22, dtype):
    vae = tiny_vae(wan22)
    for p in vae.parameters():                                   # as .to(dtype), without diffusers' casting note
        p.data = p.data.to(dtype)
    torch.manual_seed(1)
    x = (torch.rand(1, 3, 13, H, W) * 2 - 1).to(dtype)          # 13 = 1 + 4*3 frames
    with torch.no_grad():
        whole = vae.encode(x).latent_dist
    streamed = video_vae.encode_frames(vae, iter(x[0].unbind(1)))   # one frame at a time
    spatial = 8 if wan22 else 4                                  # the 2x2 patches add a factor 2
    assert streamed.parameters.shape == (1, 2 * Z, 4, H // spatial, W // spatial)
    assert torch.equal(streamed.parameters, whole.parameters)
    z = whole.mode()
    with torch.no_grad():
        decoded = vae.decode(z).sample
    chunks = list(video_vae.decode_chunks(vae, z))
    assert [c.shape[2] for c in chunks] == [1, 4, 4, 4]
    assert torch.equal(torch.cat(chunks, 2), decoded)


def test_encode_clip_streams_the_file_into_normalised_latents(clips):
    short, _ = clips
    vae = tiny_vae()
    frames = video.read_clip_frames(short, target_fps=16, num_frames=9)            # (9, 3, H, W)
    with torch.no_grad():
        mode = vae.encode(frames.permute(1, 0, 2, 3)[None]).latent_dist.mode()
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, Z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor([1.5, 0.5, 2.0, 1.0]).view(1, Z, 1, 1, 1)
    expected = ((mode - mean) * inv_std)[0]                     # as WanImageToVideoPipeline normalises
    got = video_vae.encode_clip(vae, short, target_fps=16, num_frames=9)
    assert got.shape == (Z, 3, H // 4, W // 4)
    assert torch.equal(got, expected)
    back = video_vae.denormalize(vae, got[None])
    assert torch.allclose(back, mode, atol=1e-6)                # z / (1/std) + mean undoes it (float rounding)


def test_iter_clip_frames_equals_read_clip_frames(clips, tmp_path):
    short, long = clips
    for path, fps, n, start in ((short, 16, 9, 0.0), (long, 12, 9, 0.5), (long, 16, 5, 1.2)):
        whole = video.read_clip_frames(path, target_fps=fps, num_frames=n, start_s=start, size=(16, 16))
        streamed = torch.stack(list(video_vae.iter_clip_frames(path, target_fps=fps, num_frames=n, start_s=start,
                                                               size=(16, 16))))
        assert torch.equal(streamed, whole), (path.name, fps, start)
    seq = tmp_path / "seq"
    seq.mkdir()
    for i in range(9):
        from PIL import Image
        Image.fromarray(pattern(i)).save(seq / f"f_{i:03d}.png")
    assert torch.equal(torch.stack(list(video_vae.iter_clip_frames(seq, target_fps=8, num_frames=4))),
                       video.read_clip_frames(seq, target_fps=8, num_frames=4))
    with pytest.raises(video.ClipError, match="short.mp4"):
        list(video_vae.iter_clip_frames(short, target_fps=16, num_frames=13))


def test_a_length_that_is_not_4k_plus_1_is_refused_not_truncated():
    vae = tiny_vae()
    frames = list((torch.rand(7, 3, H, W) * 2 - 1).unbind(0))
    with pytest.raises(ValueError, match="7 frames is not 4k\\+1"):
        video_vae.encode_frames(vae, frames)
    with pytest.raises(ValueError, match="expected \\(3, H, W\\)"):
        video_vae.encode_frames(vae, [torch.zeros(1, 3, H, W)])


def _peak(fn) -> int:
    tracker = LiveTensorBytes()
    with torch.no_grad(), tracker:
        fn()
    return tracker.peak


def test_streamed_peak_is_bounded_by_the_chunk_not_the_clip(clips):
    short, long = clips
    vae = tiny_vae()

    def whole(path, n):
        frames = video.read_clip_frames(path, target_fps=16, num_frames=n)
        z = vae.encode(frames.permute(1, 0, 2, 3)[None]).latent_dist.mode()
        vae.decode(z)

    def streamed(path, n):
        z = video_vae.encode_clip(vae, path, target_fps=16, num_frames=n)
        for chunk in video_vae.decode_chunks(vae, video_vae.denormalize(vae, z[None])):
            video_vae.to_uint8_frames(chunk)                      # a writer would consume it here

    pixels_long = LONG * 3 * H * W * 4                             # the long clip's fp32 pixels
    whole_short, whole_long = _peak(lambda: whole(short, 9)), _peak(lambda: whole(long, LONG))
    streamed_short, streamed_long = _peak(lambda: streamed(short, 9)), _peak(lambda: streamed(long, LONG))
    # the whole-clip calls hold the clip's pixels (in and out): their peak grows by more than the
    # added frames' pixels
    assert whole_long - whole_short > (LONG - 9) * 3 * H * W * 4, (whole_short, whole_long)
    # streamed: 3x the frames, and the peak grows only by the accumulated latents (1/48 of the pixels)
    latents_long = 2 * Z * (1 + LONG // 4) * (H // 4) * (W // 4) * 4
    assert streamed_long - streamed_short <= latents_long, (streamed_short, streamed_long)
    # and the whole-clip peak sits above the streamed one by more than the clip's pixels
    assert whole_long - streamed_long > pixels_long, (streamed_long, whole_long)


def test_decoded_latents_stream_into_an_mp4(tmp_path):
    """Latents -> frames -> mp4 without the whole video in memory, and the file holds vae.decode's frames."""
    from leantune.data import video_write

    vae = tiny_vae()
    torch.manual_seed(2)
    z = torch.randn(1, Z, 3, H // 4, W // 4)                        # 3 latent frames -> 9 frames
    with torch.no_grad():
        expected = video_vae.to_uint8_frames(vae.decode(z).sample).numpy()      # (9, H, W, 3)
    frames = video_vae.decoded_frames(vae, z)
    assert torch.equal(torch.stack(list(video_vae.decoded_frames(vae, z))), torch.from_numpy(expected))
    path = tmp_path / "sample.mp4"
    video_write.write_mp4(path, frames, 16)
    with av.open(str(path)) as c:
        back = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    assert back.shape == expected.shape
    # a random decoder's frames are close to noise, which yuv420p and H.264 blur: compared as 4x4 block means
    blocks = lambda v: v.astype(float).reshape(9, H // 4, 4, W // 4, 4, 3).mean((2, 4))   # noqa: E731
    diff = np.abs(blocks(back) - blocks(expected))
    assert diff.mean() < 4                   # 2.2 seen; frames in reverse order give 28
