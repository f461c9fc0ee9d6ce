"""Build tiny random-weight models (and a locally trained tokenizer) that vLLM loads.

Nothing is downloaded: weights are random with a fixed seed, the tokenizer is a small
BPE trained with ``tokenizers`` on generated text.  The hybrid architectures mix
sliding-window and full-attention layers (``llama-hybrid``, ``gemma3``), Mamba2 and attention
layers (``nemotron-h``) or gated-delta-net linear attention and full attention
(``qwen3-next``), so vLLM forms several KV-cache groups.

``qwen3-next`` is bf16 with head size 128: vLLM's CPU gated-delta-net kernel accepts
nothing else (it asserts bf16 and rejects head size 32).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid_nixl.common.paths import OutputDirError, checked_output_dir

__all__ = ["ARCHES", "OutputDirError", "TinyModelSpec", "build_tiny_model"]

ARCHES = ("llama", "llama-hybrid", "gemma3", "nemotron-h", "qwen3-next")
#: Architectures whose layers keep Mamba / linear-attention state.
MAMBA_ARCHES = ("nemotron-h", "qwen3-next")
# A plain chat template, so /v1/chat/completions works on the tiny models.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_WORDS = (
    "the a prefill decode engine block cache layer token model router request kv "
    "transfer hybrid sliding window full attention memory page group ray actor "
    "cluster node fast slow small large red green blue one two three four five "
    "six seven eight nine ten is was and or to of in on at by with from"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama-hybrid"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    sliding_window: int = 64
    vocab: int = 1024
    max_positions: int = 2048
    seed: int = 0
    mamba_groups: int = 1  # NemotronH's n_groups (B/C groups): TP splits them when it divides
    mlp_ratio: int = 2  # the MLP's width over hidden: compute per byte of KV grows with it


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 20))) for _ in range(lines)]


def _build_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.model_max_length = spec.max_positions
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _layer_types(spec: TinyModelSpec) -> list[str] | None:
    if spec.arch in ("llama", *MAMBA_ARCHES):
        return None
    # llama-hybrid: every other layer slides; gemma3: 2 of every 3 (its 5:1 pattern, shrunk).
    period = 3 if spec.arch == "gemma3" else 2
    types = [
        "full_attention" if (i + 1) % period == 0 else "sliding_attention"
        for i in range(spec.layers)
    ]
    types[-1] = "full_attention"
    return types


def _mamba_config(spec: TinyModelSpec, vocab_size: int):
    """Mamba2 + attention (NemotronH) or gated delta net + attention (Qwen3-Next)."""
    ids = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kinds = ["mamba" if i % 2 == 0 else "attention" for i in range(spec.layers)]
    if spec.arch == "nemotron-h":
        from transformers import NemotronHConfig

        return NemotronHConfig(
            **ids,
            hidden_size=spec.hidden,
            layers_block_type=kinds,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads,
            head_dim=spec.hidden // spec.heads,
            intermediate_size=spec.hidden * spec.mlp_ratio,
            max_position_embeddings=spec.max_positions,
            mamba_num_heads=8,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=spec.mamba_groups,
            conv_kernel=4,
            expand=2,
            chunk_size=64,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **ids,
        hidden_size=spec.hidden,
        intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers,
        layer_types=["linear_attention" if k == "mamba" else "full_attention" for k in kinds],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=spec.hidden,
        shared_expert_intermediate_size=spec.hidden,
        decoder_sparse_step=1,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def _config(spec: TinyModelSpec, vocab_size: int):
    if spec.arch in MAMBA_ARCHES:
        return _mamba_config(spec, vocab_size)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.hidden * spec.mlp_ratio,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if spec.arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **common,
            sliding_window=spec.sliding_window,
            layer_types=_layer_types(spec),
            query_pre_attn_scalar=spec.hidden // spec.heads,
            torch_dtype="float32",
        )
    from transformers import LlamaConfig

    extra: dict[str, object] = {}
    layer_types = _layer_types(spec)
    if layer_types is not None:
        extra = {"layer_types": layer_types, "sliding_window": spec.sliding_window}
    return LlamaConfig(**common, torch_dtype="float32", **extra)


def build_tiny_model(
    out: str | Path, spec: TinyModelSpec = TinyModelSpec(), overwrite: bool = False
) -> Path:
    """Write config, random weights and tokenizer to ``out``; return the directory.

    The model is written to a fresh directory beside ``out`` and renamed into place, so an
    interrupted build leaves nothing half-written and no file is written through a link.
    The same spec (seed included) always writes the same bytes.
    """
    import shutil
    import tempfile

    if spec.arch not in ARCHES:
        raise ValueError(f"unknown arch {spec.arch!r}; choose one of {', '.join(ARCHES)}")
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(
            f"hidden ({spec.hidden}) must divide by heads ({spec.heads}) and heads by "
            f"kv_heads ({spec.kv_heads})"
        )
    out = checked_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_model(staging, spec)
        if out.is_dir():
            shutil.rmtree(out)  # rmtree does not follow links inside it
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _write_model(out: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    _build_tokenizer(spec, out)
    vocab_size = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    config = _config(spec, vocab_size)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(spec.seed)
        for param in model.parameters():  # larger weights give less uniform logits
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    if spec.arch == "qwen3-next":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model_spec.json").write_text(json.dumps(spec.__dict__, indent=2))
