"""One pipeline stage of the model: its share of the decoder's layers over its TP group, the
embedding on the first stage, the final norm and the LM head on the last (tprt.parallel.stages;
with tied embeddings the last stage holds the embedding matrix too, as its head).

A stage keeps the whole model's parameter names (`layers.40.self_attn...` on a stage that starts
at layer 40): the layers other stages hold are `AbsentLayer` placeholders without parameters, so
`load_stage` (tprt.checkpoint.loading) reads exactly this stage's tensors from the same TP
checkpoint's rank files, and LoRA, gradient sync and checkpoints name everything as for the
whole model. Its forward takes the previous stage's hidden states (token ids on the first) and
returns its own, [batch, seq, hidden]; the last stage's loss is `stage_loss`. Over the paged KV
cache it runs a step's tokens as the whole model does (tprt.engine.stage_runner), its cache
holding its own layers; `forward_through` passes whole rows through every stage (evaluation,
scoring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tprt.distributed.context import TPContext
from tprt.distributed.pipeline_mesh import PipelineMesh
from tprt.errors import ConfigError
from tprt.model.config import ModelConfig, TPLayout
from tprt.model.attention import AttentionStep
from tprt.model.llama import DecoderLayer, LayerStack, RMSNorm, Step, TPLlamaForCausalLM
from tprt.model.rope import inv_frequencies
from tprt.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from tprt.parallel.layers import DENSE, LinearMethod, VocabParallelEmbedding, VocabParallelLMHead
from tprt.parallel.stages import Stage


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage holds (no parameters; never run)."""

    def forward(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        raise RuntimeError("a layer of another pipeline stage was run")


class TPLlamaStage(TPLlamaForCausalLM):
    """See the module docstring; build on the meta device and load with `load_stage`. Generation
    runs it as the whole model runs (tprt.engine.stage_runner): its KV cache holds its own layers,
    its LM head (the last stage's) gives the logits."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, ctx: TPContext, stage: Stage,
                 dtype: torch.dtype | None = None, method: LinearMethod = DENSE) -> None:
        nn.Module.__init__(self)  # the whole model's parts, but only this stage's of them
        if layout.tp != ctx.world_size:
            raise ConfigError(f"the TP layout is for {layout.tp} ranks but the TP group has {ctx.world_size}")
        self.config, self.layout, self.tp, self.stage, self.weight_method = cfg, layout, ctx, stage, method
        # The embedding, the final norm and the head exist on the stages that run them, None on the
        # others (the whole model's methods that use them are the first's or the last's). Tied
        # embeddings: the last stage holds the matrix too, as its head (`tied_embedding_grads`
        # sums the two copies' gradients).
        holds_embedding = stage.first or (stage.last and cfg.tie_word_embeddings)
        embed = VocabParallelEmbedding(layout.padded_vocab_size, cfg.hidden_size, ctx, dtype) if holds_embedding else None
        self.embed_tokens = embed  # type: ignore[assignment]
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, ctx, i, dtype, method) if i in stage.layers
                                    else AbsentLayer() for i in range(cfg.num_hidden_layers))
        for layer in self.own_layers:  # the stage's cache holds its layers only, from index 0
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.cache_layer -= stage.layers.start
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.gemma_block) if stage.last else None
        head = (VocabParallelLMHead(cfg.hidden_size, layout.padded_vocab_size, cfg.vocab_size, ctx,
                                    embed if cfg.tie_word_embeddings else None, dtype,
                                    softcap=cfg.final_logit_softcapping) if stage.last else None)
        self.norm, self.lm_head = norm, head  # type: ignore[assignment]
        self.inv_freq = inv_frequencies(cfg, device=ctx.device)
        self.local_inv_freq = None if cfg.local_rope_theta is None else inv_frequencies(cfg, ctx.device, local=True)
        self.stack: LayerStack = LayerStack()
        self.sequence_parallel = False  # not under pipeline stages yet

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def own_layers(self) -> nn.ModuleList:
        """This stage's decoder layers, in order."""
        return self.layers[self.stage.layers.start : self.stage.layers.stop]

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.own_layers

    @property
    def held_layers(self) -> range:
        return self.stage.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Training: x token ids [batch, seq] on the first stage, else the previous stage's hidden
        states [batch, seq, hidden] -> this stage's hidden states [batch, seq, hidden] (before the
        final norm on the last)."""
        return self.forward_hidden(x)

    def forward_hidden(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                       attention: AttentionStep | None = None) -> torch.Tensor:
        """As the whole model's, but from the previous stage's hidden states on every stage but
        the first: x [batch, seq] ids or [batch, seq, hidden] -> [batch, seq, hidden]; over the
        paged cache a step's [tokens] ids or [tokens, hidden] -> [tokens, hidden]."""
        x = x.to(self.tp.device, non_blocking=True)
        if attention is not None:
            if positions is not None:
                raise ValueError("positions come from the attention step")
            x = x.reshape(-1, 1, *x.shape[1:])  # [tokens, 1] ids or [tokens, 1, hidden]
            positions = attention.positions[:, None]
        elif positions is None:
            batch, seq = x.shape[:2]
            positions = torch.arange(seq, device=x.device).expand(batch, seq)  # [batch, seq]
        h = self._run_layers(self._embed(x) if self.stage.first else x, positions, attention)
        return h if attention is None else h[:, 0]


def stage_loss(stage: TPLlamaStage, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's (sum of the per-token cross-entropy, number of target tokens), as
    `tprt.train.step.compute_loss` scores the whole model's hidden states."""
    assert stage.norm is not None and stage.lm_head is not None, "the loss is the last stage's"
    target = labels[:, 1:].reshape(-1).to(hidden.device)  # [batch * (seq - 1)]
    keep = target != IGNORE_INDEX
    n_tokens = keep.sum()
    picked = hidden[:, :-1].reshape(-1, hidden.shape[-1])[keep]  # [n_tokens, hidden]
    if picked.shape[0] == 0:
        return hidden.sum() * 0.0, n_tokens
    local_logits = stage.lm_head(stage.norm(picked))
    loss = vocab_parallel_cross_entropy(local_logits, target[keep], stage.tp, vocab_size=stage.config.vocab_size)
    return loss.sum(), n_tokens


def forward_through(model: TPLlamaStage, mesh: PipelineMesh, ids: torch.Tensor) -> torch.Tensor | None:
    """A whole-sequence forward of rows `ids` [batch, seq] through the pipeline (no KV cache, no
    autograd across stages: evaluation, scoring): the last stage's hidden states [batch, seq,
    hidden] there, None on the others. Every stage needs `ids`' shape; only the first reads them."""
    if mesh.previous is None:
        x = ids
    else:
        x = torch.empty(*ids.shape, model.config.hidden_size, dtype=model.dtype, device=mesh.wire)
        dist.recv(x, mesh.previous)
    hidden = model.forward_hidden(x)
    if mesh.next is not None:
        dist.send(hidden.to(mesh.wire).contiguous(), mesh.next)
        return None
    return hidden
