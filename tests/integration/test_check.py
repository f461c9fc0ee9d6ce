"""``vllm-hybrid-nixl check``: real vLLM argument parsing and KV-cache configuration (a dry
run on the meta device, no engine), compared the way the engines compare at handshake."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_hybrid_nixl.preflight.check import run_check
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.integration

SCRIPT = Path(sys.executable).with_name("vllm-hybrid-nixl")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def check(prefill: list[str], decode: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = run_check(prefill, decode, out=out)
    return code, out.getvalue()


def base(model: Path, block_size: int = 64, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--max-model-len",
        "1024",
        "--block-size",
        str(block_size),
        *extra,
    ]


def test_cli_refuses_different_block_sizes_and_names_the_field(tiny_hybrid_model: Path) -> None:
    started = time.monotonic()
    out = subprocess.run(
        [
            str(SCRIPT),
            "check",
            "--model",
            str(tiny_hybrid_model),
            "--prefill-args",
            "--block-size 64 --max-model-len 1024",
            "--decode-args",
            "--block-size 32 --max-model-len 1024",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    elapsed = time.monotonic() - started
    print(f"check took {elapsed:.1f} s")  # reported, not asserted (shared, noisy machines)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "INCOMPATIBLE" in out.stdout
    assert "groups[0].block_size: decode 32, prefill 64" in out.stdout
    assert "different block sizes under the hybrid KV-cache allocator" in out.stdout
    table_row = next(
        line for line in out.stdout.splitlines() if line.startswith("groups[0].block_size")
    )
    assert table_row.split() == ["groups[0].block_size", "64", "32", "<>"]


def test_same_settings_are_compatible(tiny_hybrid_model: Path) -> None:
    code, text = check(base(tiny_hybrid_model), base(tiny_hybrid_model))
    assert code == 0, text
    assert "OK: prefill and decode have the same KV-cache layout" in text
    assert "<>" not in text
    # the hybrid model really has two groups, with the sliding window spelled out
    assert "groups[1].kind" in text and "sliding_window" in text


def test_our_config_files_pair_up(tiny_hybrid_model: Path) -> None:
    """The shipped prefill/decode YAML files (vllm serve --config) describe a compatible pair."""
    code, text = check(
        ["--model", str(tiny_hybrid_model), "--config", str(CONFIGS / "prefill-cpu.yaml")],
        ["--model", str(tiny_hybrid_model), "--config", str(CONFIGS / "decode-cpu.yaml")],
    )
    assert code == 0, text


def test_different_dtype_is_named(tiny_hybrid_model: Path) -> None:
    code, text = check(
        base(tiny_hybrid_model, 64, "--dtype", "float32"),
        base(tiny_hybrid_model, 64, "--dtype", "bfloat16"),
    )
    assert code == 1
    assert "dtype: decode 'bfloat16', prefill 'float32'" in text
    assert "--dtype" in text


def test_different_models_are_named(tiny_hybrid_model: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "six-layers", TinyModelSpec(layers=6))
    code, text = check(base(tiny_hybrid_model), base(other))
    assert code == 1
    assert "num_hidden_layers: decode 6, prefill 4" in text
    assert "model:" in text


def test_stock_connector_on_one_side_is_flagged(tiny_hybrid_model: Path) -> None:
    stock = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}'
    code, text = check(
        base(tiny_hybrid_model), base(tiny_hybrid_model, 64, "--kv-transfer-config", stock)
    )
    assert code == 1
    assert "decode uses vLLM's stock NixlConnector" in text


def test_bad_engine_arguments_exit_2_with_the_arguments_named(tiny_hybrid_model: Path) -> None:
    code, text = check(base(tiny_hybrid_model), base(tiny_hybrid_model, 64, "--no-such-flag"))
    assert code == 2
    assert "--no-such-flag" in text


def test_heterogeneous_tp_on_a_plain_model_gets_one_fingerprint(tmp_path: Path) -> None:
    """vLLM's NIXL compares handshake strings exactly and supports heterogeneous TP for
    single-group models: both sides must send the same string, so check and the engines
    agree."""
    plain = build_tiny_model(tmp_path / "plain", TinyModelSpec(arch="llama"))
    code, text = check(
        [*base(plain), "--tensor-parallel-size", "1"], [*base(plain), "--tensor-parallel-size", "2"]
    )
    assert code == 0, text
    fingerprint_row = next(line for line in text.splitlines() if line.startswith("fingerprint"))
    _, prefill_digest, decode_digest = fingerprint_row.split()[:3]
    assert prefill_digest == decode_digest


def test_heterogeneous_tp_on_a_hybrid_model_is_judged_by_its_splits(
    tiny_hybrid_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dry run holds each side's per-rank layout (KV heads and Mamba state at its own TP):
    a sliding-window hybrid whose 2 KV heads split over TP 2 passes, with half the page per
    rank (and is refused the other way, into a smaller decode TP); so does a Mamba2 hybrid
    with two B/C groups; one with one B/C group, which vLLM
    replicates on each TP 2 rank, is refused naming the state and what to change. The same
    verdicts as the engines in tests/e2e/test_pd_hetero_tp.py."""
    code, text = check(
        [*base(tiny_hybrid_model), "--tensor-parallel-size", "1"],
        [*base(tiny_hybrid_model), "--tensor-parallel-size", "2"],
    )
    assert code == 0, text
    assert "split over TP 1 and 2" in text
    page_row = next(line for line in text.splitlines() if line.startswith("groups[0].page_bytes"))
    prefill_page, decode_page = (int(value) for value in page_row.split()[1:3])
    assert prefill_page == 2 * decode_page
    code, text = check(  # the other way: stock's smaller decode TP died on a Mamba hybrid
        [*base(tiny_hybrid_model), "--tensor-parallel-size", "2"],
        [*base(tiny_hybrid_model), "--tensor-parallel-size", "1"],
    )
    assert code == 1, text
    assert "heterogeneous tensor parallelism (prefill TP 2, decode TP 1)" in text
    assert "prefill TP 2 into a smaller decode TP 1 is not served" in text

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # as our launchers set it
    two_groups = build_tiny_model(
        tmp_path / "nemotron-h-g2", TinyModelSpec(arch="nemotron-h", mamba_groups=2)
    )
    mamba = [*base(two_groups), "--no-enable-prefix-caching"]
    code, text = check(
        [*mamba, "--tensor-parallel-size", "1"], [*mamba, "--tensor-parallel-size", "2"]
    )
    assert code == 0, text  # B/C groups split over TP 2: the pair tests/e2e serves
    assert "split over TP 1 and 2" in text

    one_group = build_tiny_model(tmp_path / "nemotron-h", TinyModelSpec(arch="nemotron-h"))
    mamba = [*base(one_group), "--no-enable-prefix-caching"]
    code, text = check(
        [*mamba, "--tensor-parallel-size", "1"], [*mamba, "--tensor-parallel-size", "2"]
    )
    assert code == 1, text
    assert "heterogeneous tensor parallelism (prefill TP 1, decode TP 2)" in text
    state_row = next(line for line in text.splitlines() if "].state" in line and "<>" in line)
    assert "mamba2" in state_row
    assert "n_groups is not divisible by TP" in text


def test_prefix_caching_on_a_mamba_model_is_reported(tmp_path: Path) -> None:
    """Never OK. 0.32 and 0.33 build the config and our guard names the flag; 0.25 and 0.27
    refuse to build a config for this model with prefix caching at all (mamba pages cannot be
    padded to the attention pages there), and `check` exits 2 with vLLM's own reason."""
    mamba = build_tiny_model(tmp_path / "nemotron-h", TinyModelSpec(arch="nemotron-h"))
    code, text = check([*base(mamba), "--enable-prefix-caching"], base(mamba))
    if code == 2:
        assert "vLLM could not build a config from these arguments" in text, text
        assert "page size" in text, text
    else:
        assert code == 1, text
        assert "--no-enable-prefix-caching" in text


def test_different_ssm_state_dtypes_are_named(tmp_path: Path) -> None:
    """The decode engine would read the prefill's float32 SSM state as bf16: exit 1, naming
    the flag (the same pair is refused at handshake and by the router: test_pd_mamba).
    Should a release not build this model's KV-cache config at all, `check` exits 2 with
    vLLM's reason and the test says so as a skip."""
    mamba = build_tiny_model(tmp_path / "nemotron-h", TinyModelSpec(arch="nemotron-h"))
    # 128-token blocks: the attention pages then hold the Mamba pages on every release (0.25
    # and 0.27 cannot pad them to 64-token attention blocks; 0.33 finds no kernel for 16).
    args = ["--model", str(mamba), "--max-model-len", "1024", "--no-enable-prefix-caching"]
    args += ["--block-size", "128"]
    code, text = check(args, [*args, "--mamba-ssm-cache-dtype", "bfloat16"])
    if code == 2 and ("page size is not divisible" in text or "No common block size" in text):
        pytest.skip(f"this vLLM cannot build a KV-cache config for the tiny Mamba model: {text}")
    assert code == 1, text
    assert "mamba-ssm-cache-dtype" in text, text
