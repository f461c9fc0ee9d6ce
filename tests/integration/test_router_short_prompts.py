"""Conditional disaggregation's inputs: how long the router takes a prompt to be, which
prompt starts it thinks a decode engine holds (``PrefixMemory``, fed by vLLM's own
``/metrics`` page), and the setting that turns it on (``short_prompt_tokens``), from the
router's command line and the Ray config's ``router:`` section. Its effect on real engines
is in ``tests/e2e/test_integrity``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vllm_hybrid_nixl.cli import build_parser
from vllm_hybrid_nixl.deploy.ray.config import ConfigError, load_config
from vllm_hybrid_nixl.router.policy import BYTES_PER_TOKEN, prompt_tokens
from vllm_hybrid_nixl.router.prefix_memory import CHUNK_TOKENS, PrefixMemory, prompt_chunks
from vllm_hybrid_nixl.router.probes import prefix_caching_on
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


CHUNK_TEXT = "x" * (CHUNK_TOKENS * BYTES_PER_TOKEN)  # one chunk of text


def test_a_decode_engine_holds_the_prompt_starts_it_served_and_only_those() -> None:
    """Chained chunk keys: an engine that served a prompt holds every full chunk of it, so a
    prompt extending it is mostly cached there; a prompt differing in its first chunk, or
    an engine that did not cache (or restarted), holds nothing of it."""
    memory = PrefixMemory()
    memory.engine_up("http://d1", caches_prefixes=True)
    memory.engine_up("http://d2", caches_prefixes=True)
    memory.engine_up("http://d3", caches_prefixes=False)
    served = prompt_chunks({"prompt": CHUNK_TEXT * 3 + "tail"}, chat=False)
    assert served is not None and len(served.keys) == 3
    for url in ("http://d1", "http://d3"):
        memory.remember(url, served)
    longer = prompt_chunks({"prompt": CHUNK_TEXT * 4}, chat=False)
    assert longer is not None
    assert memory.best_engine(["http://d1", "http://d2", "http://d3"], longer) == (
        "http://d1",
        3 * CHUNK_TOKENS,
    )
    assert memory.cached_tokens("http://d3", longer) == 0  # prefix caching off there
    other_start = prompt_chunks({"prompt": "y" + CHUNK_TEXT * 4}, chat=False)
    assert other_start is not None and memory.best_engine(["http://d1"], other_start) == (None, 0)
    tokens = prompt_chunks({"prompt": list(range(CHUNK_TOKENS * 2 + 5))}, chat=False)
    assert tokens is not None and len(tokens.keys) == 2
    assert prompt_chunks({"prompt": ["a", "b"]}, chat=False) is None  # a batch: not one prompt
    assert prompt_chunks({"prompt_embeds": "AAAA", "prompt": CHUNK_TEXT}, chat=False) is None
    memory.engine_up("http://d1", caches_prefixes=True)  # came back up: its cache is empty
    assert memory.cached_tokens("http://d1", longer) == 0


def test_a_conversation_that_grows_by_a_turn_keeps_its_earlier_keys() -> None:
    first = [{"role": "user", "content": CHUNK_TEXT * 2}]
    grown = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    a = prompt_chunks({"messages": first}, chat=True)
    b = prompt_chunks({"messages": grown}, chat=True)
    assert a is not None and b is not None and len(a.keys) == 2
    assert b.keys[: len(a.keys)] == a.keys
    assert prompt_chunks({"messages": "not a list"}, chat=True) is None


def test_the_memory_keeps_its_newest_entries_within_its_capacity() -> None:
    memory = PrefixMemory(capacity=4)
    memory.engine_up("http://d1", caches_prefixes=True)
    old = prompt_chunks({"prompt": "a" + CHUNK_TEXT * 3}, chat=False)
    new = prompt_chunks({"prompt": "b" + CHUNK_TEXT * 3}, chat=False)
    assert old is not None and new is not None
    memory.remember("http://d1", old)
    memory.remember("http://d1", new)
    assert len(memory) == 4
    assert memory.cached_tokens("http://d1", new) == 3 * CHUNK_TOKENS
    # the older prompt lost its tail first (as the engine's own cache would): its start stays
    assert memory.cached_tokens("http://d1", old) == CHUNK_TOKENS
    with pytest.raises(ValueError, match="at least one chunk"):
        PrefixMemory(capacity=0)


def test_prefix_caching_is_read_from_vllms_cache_config_gauge() -> None:
    """The router routes by prefix only to engines whose ``vllm:cache_config_info`` says
    ``enable_prefix_caching="True"``; a page that does not say, or is not a metrics page,
    reads as unknown (no routing by prefix)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    pages = {}
    for flag in ("True", "False"):
        registry = CollectorRegistry()
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "enable_prefix_caching", "engine"],
            registry=registry,
        )
        gauge.labels("16", flag, "0").set(1)
        pages[flag] = generate_latest(registry).decode()
    assert prefix_caching_on(pages["True"]) is True
    assert prefix_caching_on(pages["False"]) is False
    assert prefix_caching_on("# HELP other x\n# TYPE other gauge\nother 1\n") is None
    assert prefix_caching_on("{{{ not metrics") is None


def test_what_vllm_caches_apart_is_remembered_apart() -> None:
    """vLLM's block hashes change with the model (a LoRA) and ``cache_salt``, and a prompt
    truncated from the left is not the prompt sent: none of them shares keys with the plain
    prompt; a chat chunk's JSON overhead does not make more of a prompt look cached."""
    text = CHUNK_TEXT * 2
    plain = prompt_chunks({"model": "m", "prompt": text}, chat=False)
    salted = prompt_chunks({"model": "m", "prompt": text, "cache_salt": "tenant-a"}, chat=False)
    other_model = prompt_chunks({"model": "m-lora", "prompt": text}, chat=False)
    assert plain is not None and salted is not None and other_model is not None
    assert not set(plain.keys) & set(salted.keys)
    assert not set(plain.keys) & set(other_model.keys)
    truncated = {"model": "m", "prompt": text, "truncate_prompt_tokens": 10}
    assert prompt_chunks(truncated, chat=False) is None
    chat = prompt_chunks({"messages": [{"role": "user", "content": "a\n" * 300}]}, chat=True)
    assert chat is not None and chat.keys
    all_cached = len(chat.keys) * CHUNK_TOKENS
    assert chat.cached_share(all_cached) < 1.0  # the tail past the last full chunk is not
    assert plain.cached_share(2 * CHUNK_TOKENS) == 1.0
