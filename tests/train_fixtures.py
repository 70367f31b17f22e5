"""Fixtures for the fine-tuning tests: a tiny byte-level BPE tokenizer with a ChatML template,
and tiny Llama checkpoints (HF and TP) that use it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers import make_hf_llama

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
VOCAB = 320
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "What is the capital of France? The capital of France is Paris.",
    "system user assistant You are a helpful assistant. Answer briefly.",
    "Numbers 12345 and symbols #$%^&*() tabs\tand  spaces\nnew lines\n",
]


def write_tokenizer(d: Path, template: str = CHATML) -> Path:
    """tokenizer.json (byte-level BPE, vocabulary VOCAB) and tokenizer_config.json into `d`."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    d.mkdir(parents=True, exist_ok=True)
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(d / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template,
                           "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def make_tiny_model(root: Path, tp: int, name: str = "gqa", seed: int = 0) -> tuple[Path, Path]:
    """(HF dir, TP dir) of a tiny fp32 Llama with the test tokenizer, converted to `tp` ranks.

    Weights are drawn 10x wider than HF's default (std 0.2): with std 0.02 the logits of a
    64-wide model cannot leave the neighbourhood of a uniform distribution without training the
    LM head, so a LoRA run could not show a falling loss."""
    from convert.api import hf_to_tp

    hf = make_hf_llama(root / f"{name}-hf", name, seed=seed, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, initializer_range=0.2)
    write_tokenizer(hf)
    tp_dir = root / f"{name}-tp{tp}"
    hf_to_tp(hf, tp_dir, tp)
    return hf, tp_dir


def write_random_adapter(path: Path, config: Any, targets: Sequence[str], rank: int, seed: int,
                         b_scale: float) -> None:
    """A PEFT LoRA adapter directory for a model of `config` (tprt.model.config.ModelConfig) with
    seeded random A (unit-scale rows) and B (times `b_scale`, so it changes the outputs)."""
    import torch
    from safetensors.torch import save_file

    from tprt.lora.fit import in_out
    from tprt.lora.peft_io import adapter_config, peft_key

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for t in targets:
            n_in, n_out = in_out(config, t)
            tensors[peft_key(layer, t, "A")] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[peft_key(layer, t, "B")] = torch.randn(n_out, rank, generator=g) * b_scale
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(list(targets), rank, 2.0 * rank, 0.0, None)))
