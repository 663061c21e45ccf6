"""CUDA runs turn cuDNN's fused attention off (leantune/memory/attention_kernels.py)."""

import torch

from leantune.memory import attention_kernels


def _fresh(monkeypatch, env=None):
    monkeypatch.setattr(attention_kernels, "_done", False)
    if env is None:
        monkeypatch.delenv("LEANTUNE_CUDNN_SDP", raising=False)
    else:
        monkeypatch.setenv("LEANTUNE_CUDNN_SDP", env)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr(attention_kernels, "_restore", was, raising=False)


def test_a_cuda_run_turns_cudnn_attention_off_once_and_a_cpu_run_does_not(monkeypatch):
    _fresh(monkeypatch)
    try:
        attention_kernels.guard_attention_kernels(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        attention_kernels.guard_attention_kernels(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(True)      # a user's own choice after set-up stays
        attention_kernels.guard_attention_kernels(torch.device("cuda", 0))
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(attention_kernels._restore)


def test_the_environment_can_allow_cudnn_attention(monkeypatch):
    _fresh(monkeypatch, env="1")
    try:
        attention_kernels.guard_attention_kernels(torch.device("cuda", 0))
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(attention_kernels._restore)
