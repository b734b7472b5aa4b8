"""The embedded default model: a tiny random-weight Llama plus a byte-level tokenizer.

Owns: building it deterministically from a `TinySpec` (no download), caching it under the
user's cache dir keyed by the spec, and resolving `model.path` ("tiny" or a local HF directory).
Does not own: loading it into an engine (see `policies.vllm_policy`).

Token ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>, then the 256 bytes at 4..259 (GPT-2 byte-level
alphabet, no merges), so every id the model can sample detokenizes to text.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgspec

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# A minimal chat template for the byte tokenizer: `<role>content<eos>` per message (a tool list as
# JSON), `<assistant>` opens the model's turn, `<eos>` (id 2) ends it. Tool calls are written
# hermes-style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which vLLM's `hermes`
# parser (`serve.tool_parser`, the default) reads back.
CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}<eos>{% endif -%}"
    "{%- for m in messages -%}"
    "<{{ m['role'] }}>{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, "
    '"arguments": '
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}"
    "}</tool_call>{%- endfor %}<eos>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<assistant>{% endif -%}"
)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
FIRST_BYTE_ID = len(SPECIAL_TOKENS)


class TinySpec(msgspec.Struct, frozen=True):
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = FIRST_BYTE_ID + 256
    max_position_embeddings: int = 32768  # RoPE: any length; long-context configs need room
    init_std: float = 0.08
    seed: int = 0
    tokenizer_version: int = 3  # 2: with a chat template; 3: tool calls hermes-style
    # Special tokens after the 256 bytes (ids 260, ...), for parsers that look one up (vLLM's
    # `llama3_json` needs `<|python_tag|>`); vocab_size must count them.
    extra_special: tuple[str, ...] = ()

    def key(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("ROLLOUT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout"
    )
    return Path(base)


def resolve_model_path(path: str, seed: int = 0) -> Path:
    """`tiny` -> the embedded model (built on first use); anything else must be a local HF dir.

    Raises FileNotFoundError naming the path when a directory has no `config.json`.
    """
    if path == "tiny":
        return build_tiny(TinySpec(seed=seed))
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {path!r} is not 'tiny' nor a directory with a config.json")
    return p


def build_tiny(spec: TinySpec = TinySpec(), root: Path | None = None) -> Path:
    """Build (once) and return the directory of the tiny model for `spec`."""
    out = (root or cache_root()) / f"tiny-llama-{spec.key()}"
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _write_model(spec, tmp)
    _write_tokenizer(spec, tmp)
    (tmp / "DONE").write_text(msgspec.json.encode(spec).decode())
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_model(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * spec.init_std)
    model.save_pretrained(out, safe_serialization=True)


def _write_tokenizer(spec: TinySpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes, GPT-2 style
    byte_chars = sorted(alphabet, key=_byte_of)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: FIRST_BYTE_ID + i for i, ch in enumerate(byte_chars)})
    vocab.update({t: FIRST_BYTE_ID + 256 + i for i, t in enumerate(spec.extra_special)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIAL_TOKENS, *spec.extra_special])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": spec.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
