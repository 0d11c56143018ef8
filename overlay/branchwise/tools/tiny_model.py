"""Build the embedded default model: a tiny random-weight Llama and a locally trained tokenizer."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIALS = ("<s>", "</s>", "<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
BRANCH_TAGS = (
    "<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Goal>", "</Goal>", "<Outline>", "</Outline>",
    "<Path>", "</Path>", "<Conclusion>", "</Conclusion>",
    "<Plan>", "</Plan>", "<Task", "</Task>", "<Execution", "</Execution>", "<Answer>", "</Answer>",
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = tuple((
    "the a of to and in is it that for on with as was at by be this are from or an have not they "
    "which one you were all we can there their will would what about when if so more no out up time "
    "plan task path goal answer think step first second then result sum value check compute list "
    "branch merge parallel serial token model request server cache prefix decode batch"
).split())
LLAMA_CONFIG = MappingProxyType(dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
))
SIZES = MappingProxyType({
    "tiny": LLAMA_CONFIG,
    "small": MappingProxyType(LLAMA_CONFIG | dict(hidden_size=1024, num_hidden_layers=4,
                                                  num_attention_heads=16, num_key_value_heads=4,
                                                  intermediate_size=2816)),
})


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = rng.choices(WORDS, k=rng.randint(4, 16))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]) + f" {rng.randint(0, 999)}")
    return out


def build_tokenizer(seed: int, vocab_size: int = 440) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in BRANCH_TAGS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a random-weight Llama checkpoint + tokenizer to `out`; deterministic for a given seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32", **SIZES[size],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # larger logits so greedy text varies a little more than the default init
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    meta = {"seed": seed, "vocab_size": vocab} | ({"size": size} if size != "tiny" else {})
    (out / "branchwise_tiny.json").write_text(json.dumps(meta) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = ap.parse_args()
    path = build(args.out, args.seed, args.size)
    print(f"{args.size} model written to {path}")


if __name__ == "__main__":
    main()
