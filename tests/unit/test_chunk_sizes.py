"""`--chunk-size auto`: StreamBP's chunk sizes chosen from the point by one rule, recorded as numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sbpbench.config import MaxlenSpec, point_specs
from sbpbench.methods.chunk_sizes import LAYER_CHUNK_MAX, PAPER_CHUNK, auto_chunk_sizes
from sbpbench.models import load_config
from sbpbench.settings import EXACTNESS_DEFAULTS
from sbpbench.workload.rows import spec_fields

GIB = 2**30


def test_the_rule_follows_t_up_to_its_cap_and_memory_first():
    """T/3 from the paper's 500 (3000 at T = 9000, its timing setting) to 4096 at 100k+; a smaller
    budget or a wider model cuts it (each chunk within 2% of the memory); the logits chunk is
    memory-bound, larger with a smaller vocabulary."""
    qwen8, qwen32 = load_config("Qwen/Qwen3-8B"), load_config("Qwen/Qwen3-32B")
    sizes = lambda config, t, memory=None: auto_chunk_sizes(
        config, seq_len=t, batch_size=1, dtype_bytes=2, memory_bytes=memory
    )
    assert sizes(qwen8, 600).chunk_size == PAPER_CHUNK
    assert sizes(qwen8, 9000).chunk_size == 3000
    assert sizes(qwen8, 100_000).chunk_size == sizes(qwen8, 1_048_576).chunk_size == LAYER_CHUNK_MAX
    assert sizes(qwen8, 100_000, 24 * GIB).chunk_size < 2000 < sizes(qwen8, 100_000).chunk_size
    assert sizes(qwen32, 100_000).chunk_size < LAYER_CHUNK_MAX  # wider layers: fewer positions in 2%
    assert 100 < sizes(qwen8, 100_000).logits_chunk_size < sizes(load_config("small/qwen3"), 100_000).logits_chunk_size
    chunk, logits = sizes(qwen8, 100_000)
    share = 0.02 * 80 * GIB
    assert chunk * 2 * (6 * 4096 + 4 * 12288) * 2 <= share and logits * 12 * 151936 <= share


def test_auto_is_the_default_and_rows_record_the_numbers_chosen():
    """sbp run's StreamBP point holds the numbers the rule chose and names them auto_settings, as its
    row (and key) do; an explicit size is used as given and not named; bp reads none."""
    bp, streambp = point_specs({"device": "cpu", "model": "small/qwen3", "seq_len": 2048}, ["bp", "streambp"])
    assert (streambp.settings.chunk_size, streambp.settings.logits_chunk_size) == (683, 1024)
    assert streambp.auto_settings == ("chunk_size", "logits_chunk_size") and bp.auto_settings == ()
    row = spec_fields(streambp)
    assert (row["chunk_size"], row["logits_chunk_size"]) == (683, 1024)  # ceil(2048 / 3); small/qwen3's 32k vocab
    assert row["auto_settings"] == "chunk_size;logits_chunk_size"
    assert spec_fields(bp)["chunk_size"] is None and spec_fields(bp)["auto_settings"] == ""
    (given,) = point_specs({"device": "cpu", "model": "small/qwen3", "seq_len": 2048, "chunk_size": 500}, ["streambp"])
    assert (spec_fields(given)["chunk_size"], spec_fields(given)["auto_settings"]) == (500, "logits_chunk_size")


def test_a_search_chooses_afresh_at_each_probe_and_sbp_check_stays_explicit():
    """A max-length probe at another T chooses the rule's sizes for its own T (replace keeps the
    numbers); `sbp check`'s defaults are explicit."""
    (base,) = point_specs({"device": "cpu", "model": "small/qwen3", "seq_len": 1500, "repeats": 0}, ["streambp"])
    search = MaxlenSpec(base=base, seq_len_ceiling=16384)
    assert search.probe(1500).settings.chunk_size == 500
    assert search.probe(9000).settings.chunk_size == 3000 and search.probe(9000).auto_settings == base.auto_settings
    assert replace(base, seq_len=9000).settings.chunk_size == 500
    assert EXACTNESS_DEFAULTS["chunk_size"] == 128 and EXACTNESS_DEFAULTS["logits_chunk_size"] == 100
    check = point_specs({}, ["streambp"], defaults=EXACTNESS_DEFAULTS)[0]
    assert check.auto_settings == () and check.settings.chunk_size == 128


@pytest.mark.parametrize("value", ["auto", "AUTO!", "0"])
def test_auto_and_only_sizes_are_accepted(value):
    """ "auto" is a size; anything else that is not a positive size is refused naming what is allowed."""
    from sbpbench.config import ConfigError

    settings = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 64, "logits_chunk_size": value}
    if value == "auto":
        (spec,) = point_specs(settings, ["streambp"])
        assert spec.settings.logits_chunk_size == 1024 and "logits_chunk_size" in spec.auto_settings
        return
    with pytest.raises(ConfigError, match='"auto"'):
        point_specs(settings, ["streambp"])
