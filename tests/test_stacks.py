"""The decoder stack is one swappable object on the model (`model.stack`): the reference
`LayerStack`, training's `CheckpointedStack`, and the CPU native stack, chosen in the open. The
checkpointed stack gives the reference's loss and gradients; the native stack the reference's
logits (and the same KV cache) for decode steps it takes, and the reference's path for the rest."""

from __future__ import annotations

import pytest
import torch

from helpers import force_native_decode, forward_rows
from tprt.distributed.context import TPContext
from tprt.model.config import ModelConfig, TPLayout
from tprt.model.llama import CheckpointedStack, LayerStack, Step, TPLlamaForCausalLM
from tprt.model.rope import rope_angles
from tprt.parallel.layers import ParallelLinear
from tprt.train.step import enable_activation_checkpointing

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=64, tie_word_embeddings=False)


def _model(dtype: torch.dtype = torch.float32) -> TPLlamaForCausalLM:
    """A tiny random model, built and loaded as the loader does (meta, assign, post-process)."""
    with torch.device("meta"):
        model = TPLlamaForCausalLM(CFG, TPLayout.for_model(CFG, 1), TPContext.single(), dtype)
    gen = torch.Generator().manual_seed(0)
    state = {name: (1 + torch.randn(p.shape, generator=gen) / 10 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=gen) / 8).to(dtype)
             for name, p in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    for layer in model.modules():
        if isinstance(layer, ParallelLinear):
            layer.method.process_after_loading(layer)
    return model.eval()


def test_the_reference_stack_is_the_default_and_owns_no_parameters() -> None:
    model = _model()
    assert type(model.stack) is LayerStack
    assert not any(".stack" in name or name.startswith("stack") for name in model.state_dict())
    ids = torch.tensor([[1, 5, 9, 3], [7, 2, 0, 0]])
    with torch.no_grad():  # the stack is the layers run in turn, nothing else
        h = model.embed_tokens(ids)
        cos, sin = rope_angles(torch.arange(4).expand(2, 4), model.inv_freq, h.dtype)
        for layer in model.layers:
            h = layer(h, Step(cos, sin))
        assert torch.equal(model.forward_hidden(ids), h)


def test_checkpointed_stack_gives_the_reference_loss_and_gradients() -> None:
    """Batch 2, uneven lengths (padding -100 in the labels): the same loss and gradients with
    activations recomputed in the backward; switching back restores the reference stack."""
    from tprt.train.step import compute_loss

    ids = torch.tensor([[1, 5, 9, 3, 4, 8], [7, 2, 6, 0, 0, 0]])
    labels = torch.tensor([[5, 9, 3, 4, 8, -100], [2, 6, -100, -100, -100, -100]])
    results = []
    for checkpointed in (False, True):
        model = _model()
        model.requires_grad_(True).train()
        enable_activation_checkpointing(model, checkpointed)
        assert type(model.stack) is (CheckpointedStack if checkpointed else LayerStack)
        loss_sum, n = compute_loss(model, ids, labels)
        (loss_sum / n).backward()
        results.append((loss_sum.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss_ck, grads_ck) = results
    assert torch.equal(loss_ref, loss_ck)
    assert grads_ref.keys() == grads_ck.keys()
    for name, g in grads_ref.items():
        assert g is not None and torch.allclose(g, grads_ck[name], rtol=1e-5, atol=1e-7), name
    enable_activation_checkpointing(model, False)
    assert type(model.stack) is LayerStack


@pytest.mark.parametrize("rows", [1, 3])
def test_native_stack_gives_the_reference_logits(rows: int) -> None:
    """Decode steps of 1 and 3 rows over a float32 cache: the native stack (every layer in one
    compiled call) against the reference stack on the same model, same logits and KV cache."""
    from tprt.cpu import native
    from tprt.cpu.fast_linear import prepack, supported
    from tprt.cpu.native_layers import NativeDecodeStack, install_native_layers, install_native_stack

    reference, model = _model(), _model()
    if not supported(model) or not native.available():
        pytest.skip("no oneDNN or no C compiler here: the native stack is not installed")
    prepack(model, tune=False)
    install_native_layers(model)
    assert type(model.stack) is LayerStack  # packed one-row products: no native halves, no stack
    calls = force_native_decode(model)  # every layer's halves, then the stack over them
    stack = model.stack
    assert isinstance(stack, NativeDecodeStack)
    caches = [m.new_cache(24, 4) for m in (reference, model)]
    prompts = [[1, 5, 9, 3, 4], [7, 2], [11, 12, 13]][:rows]
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])[:rows]
    with torch.inference_mode():
        for m, cache in zip((reference, model), caches):
            for i, p in enumerate(prompts):  # prefill: a prompt of a few tokens (the stack takes it)
                forward_rows(m, cache, [p], [0], tables[i : i + 1])
        prefill_calls = calls[1]
        positions = [len(p) for p in prompts]
        for step in range(3):
            ids = [[20 + step + r] for r in range(rows)]
            want = torch.cat(forward_rows(reference, caches[0], ids, positions, tables))
            got = torch.cat(forward_rows(model, caches[1], ids, positions, tables))
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), step
            assert (caches[1].kv - caches[0].kv).abs().max() <= 1e-5 * caches[0].kv.abs().max(), step
            positions = [p + 1 for p in positions]
    assert calls[1] - prefill_calls == 3, calls  # every decode step ran in the stack's one call
    assert install_native_stack(model) is not None and isinstance(model.stack, NativeDecodeStack)
    model.stack = LayerStack()  # swapped back: the layers one by one again
    with torch.inference_mode():
        again = torch.cat(forward_rows(model, caches[1], ids, [p - 1 for p in positions], tables))
    assert (again - want).abs().max() <= 1e-4 * want.abs().max()
