"""Which SDPA kernel each method ran, recorded in its row, and `--sdpa-backend` forcing one for all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import ConfigError, RunSpec
from sbpbench.measure.sdpa import RecordingSdpaBackends, forcing_sdpa_backend
from sbpbench.methods import MethodSettings
from sbpbench.runner import point


def _spec(method: str, **values) -> RunSpec:
    base = {"model": "tiny/qwen3", "seq_len": 64, "warmup": 0, "repeats": 0, "settings": MethodSettings(chunk_size=16)}
    return RunSpec(method=method, **{**base, **values})


def test_the_recorder_names_the_kernel_that_ran_lower_right_bias_included():
    """The CPU dispatches plain causal attention and StreamBP's lower-right CausalBias (which skips the
    dispatcher's choice) to its flash kernel; forced math runs math; the recorder sees each."""
    q, k = torch.randn(1, 4, 8, 16, requires_grad=True), torch.randn(1, 4, 24, 16)
    with RecordingSdpaBackends() as seen:
        F.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(8, 24)).sum().backward()
    assert seen.names() == "flash"
    with forcing_sdpa_backend("math"), RecordingSdpaBackends() as seen:
        F.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(8, 24))
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert seen.names() == "math"


@pytest.mark.parametrize("method", ["bp", "streambp"])
def test_every_row_records_its_kernel_and_forcing_math_is_honoured(method):
    """bp (transformers' sdpa attention) and streambp (its own attention function): a row records the
    kernel its memory step ran (the CPU's flash by default) and, with sdpa_backend math, runs and
    records math, its loss the same to rounding."""
    auto = point.measure_point(_spec(method))
    forced = point.measure_point(_spec(method, sdpa_backend="math"))
    assert (auto.status, forced.status) == ("ok", "ok"), (auto.error, forced.error)
    assert (auto.sdpa_backend, auto.attention_kernel) == ("auto", "flash")
    assert (forced.sdpa_backend, forced.attention_kernel) == ("math", "math")
    assert forced.loss == pytest.approx(auto.loss, rel=1e-5)


def test_a_backend_the_cpu_lacks_is_refused_before_anything_runs(tmp_path):
    """efficient and cuDNN exist only on CUDA: a one-line error naming what the CPU has, exit 2, no row."""
    with pytest.raises(ConfigError, match="no CPU kernel.*auto, flash, math"):
        _spec("bp", sdpa_backend="efficient")
    out = tmp_path / "r.csv"
    result = CliRunner().invoke(
        app, ["run", "--device", "cpu", "--model", "tiny/qwen3", "--sdpa-backend", "cudnn", "--out", str(out)]
    )
    assert result.exit_code == 2 and "--sdpa-backend cudnn has no CPU kernel" in result.output
    assert not out.exists()


def test_a_forced_kernel_that_cannot_run_the_attention_is_an_unsupported_row(monkeypatch):
    """When the forced kernel refuses the point's attention at run time (as flash refuses fp32 on a
    GPU), the point is a row with status unsupported and the reason, not a crash: here the CPU made to
    run with only the efficient kernel enabled."""
    monkeypatch.setattr(point, "forcing_sdpa_backend", lambda name: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
    row = point.measure_point(_spec("streambp", sdpa_backend="flash"))
    assert row.status == "unsupported"
    assert row.error.startswith("--sdpa-backend flash cannot run this attention on cpu:")
