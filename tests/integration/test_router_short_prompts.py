"""Conditional disaggregation's inputs: how long the router takes a prompt to be, and the
setting that turns it on (``short_prompt_tokens``), from the router's command line and the
Ray config's ``router:`` section. Its effect on real engines is in ``tests/e2e/test_integrity``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vllm_hybrid_nixl.cli import build_parser
from vllm_hybrid_nixl.deploy.ray.config import ConfigError, load_config
from vllm_hybrid_nixl.router.policy import BYTES_PER_TOKEN, prompt_tokens
from vllm_hybrid_nixl.router.settings import RouterSettings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_token_id_prompts_are_counted_and_text_is_estimated() -> None:
    assert prompt_tokens({"prompt": [1, 2, 3, 4, 5]}, chat=False) == 5
    assert prompt_tokens({"prompt": "x" * (10 * BYTES_PER_TOKEN)}, chat=False) == 10
    assert prompt_tokens({"prompt": "x" * (10 * BYTES_PER_TOKEN + 1)}, chat=False) == 11
    # by UTF-8 bytes: a CJK character is three, nearer its share of a token than one
    assert prompt_tokens({"prompt": "\u6f22" * 400}, chat=False) == 1200 // BYTES_PER_TOKEN
    messages = [
        {"role": "system", "content": "ab" * 8},
        {"role": "user", "content": [{"type": "text", "text": "cd" * 8}]},
    ]
    assert prompt_tokens({"messages": messages}, chat=True) == 32 // BYTES_PER_TOKEN


def test_each_endpoint_is_measured_by_the_field_it_reads() -> None:
    """A chat body's ``prompt`` (which vLLM's chat endpoint ignores) cannot make a long
    conversation look short, nor ``messages`` a long completions prompt."""
    long_chat = {"messages": [{"role": "user", "content": "x" * 100_000}], "prompt": ""}
    assert prompt_tokens(long_chat, chat=True) == 100_000 // BYTES_PER_TOKEN
    long_prompt = {"prompt": "x" * 100_000, "messages": []}
    assert prompt_tokens(long_prompt, chat=False) == 100_000 // BYTES_PER_TOKEN


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        ({"prompt": ["one", "two"]}, False),  # a batch: split before the policy asks
        ({"prompt": [[1, 2], [3]]}, False),
        ({"prompt": [True, False]}, False),
        ({"prompt": "", "prompt_embeds": "..."}, False),  # embeddings: tokens unknown
        ({}, False),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "u"}},
                            {"type": "text", "text": "hi"},
                        ],
                    }
                ]
            },
            True,
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, True),
    ],
    ids=["batch", "token-batch", "bools", "embeds", "empty", "image-part", "tools"],
)
def test_a_body_whose_length_cannot_be_told_goes_p_d(body: dict, chat: bool) -> None:
    assert prompt_tokens(body, chat=chat) is None


def test_short_prompts_go_p_d_unless_a_threshold_is_set() -> None:
    assert RouterSettings().short_prompt_tokens == 0
    args = build_parser().parse_args(
        ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
         "--short-prompt-tokens", "256"]
    )  # fmt: skip
    assert args.short_prompt_tokens == 256
    assert RouterSettings(short_prompt_tokens=256).short_prompt_tokens == 256
    with pytest.raises(ValueError, match="short_prompt_tokens"):
        RouterSettings(short_prompt_tokens=-1)


def test_a_ray_config_sets_the_threshold_in_its_router_section(tmp_path) -> None:
    config = REPO / "configs" / "ray" / "1p1d-cpu.yaml"
    data = yaml.safe_load(config.read_text())
    data["model"] = "ibm-granite/granite-4.0-h-tiny"  # an id: not looked up here
    data.setdefault("router", {})["short_prompt_tokens"] = 128
    written = tmp_path / "pd.yaml"
    written.write_text(yaml.safe_dump(data))
    assert load_config(written).router.short_prompt_tokens == 128
    data["router"]["short_prompt_tokens"] = "many"
    written.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="router.short_prompt_tokens"):
        load_config(written)


def test_a_setting_on_by_default_can_be_turned_off_from_the_command_line() -> None:
    engines = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    parser = build_parser()
    assert parser.parse_args(engines).colocated_fallback is None  # not given: the default
    assert parser.parse_args([*engines, "--no-colocated-fallback"]).colocated_fallback is False
    assert parser.parse_args([*engines, "--protect-probes"]).protect_probes is True
