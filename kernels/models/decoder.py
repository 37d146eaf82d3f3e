"""The decoder every family runs: our own forward over a paged KV cache.

One module, `CausalLM`, built from a `ModelSpec`: the options a family sets
(kernels/models/families/) are options of its layers — q/k norms, biases, the gated MLP's
activation, sandwich norms, soft-capping, sliding-window layers with their own RoPE, an
embedding multiplier. q/k/v and gate/up projections are fused into one matmul each (the
loader concatenates the checkpoint's weights once, or takes them fused where the checkpoint
stores them so). The model is built on the meta device; the loader assigns real tensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tokenloom.actors.kv.groups import KVGroups
from tokenloom.kernels.attention import paged_attention, with_chunk_masks
from tokenloom.kernels.cpu import kernel_plan, kernel_set
from tokenloom.kernels.cpu import linear as cpu_linear
from tokenloom.kernels.forward_context import AttentionMetadata
from tokenloom.kernels.kv_store import KVCache, store_kv
from tokenloom.kernels.models.layers import (
    GATED_ACTIVATIONS,
    RMSNorm,
    RotaryEmbedding,
    add_rms_norm,
    apply_rope,
    rope_and_store,
    softcap,
)
from tokenloom.kernels.models.model_spec import ModelSpec
from tokenloom.startup_log import startup_log

# On CPU, decoder layers whose weights fit in a core's cache and whose multiply-add work for
# the step is below these run on one thread; the LM head keeps every thread. Such small
# matmuls gain nothing from a second thread but pay a barrier each, and stall whenever
# another thread holds the other core (the serving event loop, a client): ~5% of a tiny
# model's HTTP throughput at 64 decodes. Real models stream megabytes of weights a layer
# (SmolLM2-135M: 14 MB in fp32) and keep every thread, even at batch 1.
ONE_THREAD_LAYER_BYTES = 2 << 20
ONE_THREAD_LAYER_WORK = 4_000_000


def rms_norm(spec: ModelSpec, size: int) -> RMSNorm:
    return RMSNorm(size, spec.rms_norm_eps, fp32_scale=spec.norm_offset != 0)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.scale
        # The layer's options: the last `window` positions only (None: all), scores
        # soft-capped (None: not), which RoPE table it rotates with.
        self.window = spec.window(layer)
        self.softcap = spec.attn_logit_softcap
        self.local_rope = spec.rope_local is not None and self.window is not None
        self.kv_group = 0   # its layer group's block tables (CausalLM sets it)
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE.
        self.q_norm = rms_norm(spec, spec.head_dim) if spec.qk_norm else None
        self.k_norm = rms_norm(spec, spec.head_dim) if spec.qk_norm else None
        self.decode_fn = None  # None: torch reference; see CausalLM.set_decode_kernel
        self.prefill_fn = None  # None: torch SDPA; see CausalLM.set_prefill_kernel
        self.store_fn = None   # None: kv_store.store_kv; see CausalLM.set_kv_store_kernel
        # None: rope_and_store + the KV store above; else a kernel that rotates q and k and
        # writes k and v into the cache in one launch (CausalLM.set_fused_kernels).
        self.rope_store_fn = None
        # The runtime check of a quantized KV cache (kernels/kv_quality_check.py) and this
        # layer's index in it; None: off (CausalLM.set_kv_check).
        self.kv_check = None
        self.layer_index = 0
        # cache.kv_rotation: an orthonormal [D, D] rotation applied to q, k and v before the
        # (quantized) cache and undone on the attention output; None: off.
        self.kv_rotation: torch.Tensor | None = None
        self.kv_unrotation: torch.Tensor | None = None   # its transpose, contiguous
        # LoRA deltas of the qkv and o projections (kernels/lora/stacks.LoRADelta); None:
        # the engine serves no adapters (CausalLM.enable_lora).
        self.lora_qkv = None
        self.lora_o = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        lora = meta.lora
        q, k, v = self.project(x, cos, sin, key_cache, value_cache, meta.slot_mapping,
                               meta.has_skip_slots, lora)
        check = self.kv_check
        if check is not None and check.recording:
            check.record(self.layer_index, k, v)
        o = self.attend(q, key_cache, value_cache, meta, k, v)
        if check is not None and check.checking:
            check.check(self.layer_index, q, key_cache, value_cache, self.scale)
        o = self.unrotate(o).reshape(x.shape[0], self.q_size)
        out = self.o_proj(o)
        return out if lora is None or self.lora_o is None else self.lora_o(o, out, lora)

    def unrotate(self, o: torch.Tensor) -> torch.Tensor:
        """Attention's output [..., D] back from the rotated basis (identity when off)."""
        r = self.kv_unrotation
        return o if r is None else _rotate(o.reshape(-1, self.head_dim), r).view(o.shape)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                has_skip_slots: bool, lora=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the step's tokens, rotated; k and v also written into the cache at
        `slot_mapping` (slot -1: skipped). Everything before attention, and shape-static:
        a piecewise graph captures it (graphs/piecewise.py). `lora`: the step's LoRABatch
        (None: no row has an adapter)."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                          # [T, q + 2kv]
        if lora is not None and self.lora_qkv is not None:
            qkv = self.lora_qkv(x, qkv, lora)
        if self.q_norm is not None:
            qkv = self.norm_qk(qkv)
        if self.rope_store_fn is not None:
            return self.rope_store_fn(qkv, cos, sin, h, kvh, d, key_cache, value_cache,
                                      slot_mapping)
        r = self.kv_rotation
        if r is None:
            q, k, v = rope_and_store(qkv, cos, sin, h, kvh, d)
        else:
            # q.k and p.v are unchanged by an orthonormal rotation of all three, but an
            # outlier channel of k or v is spread over the whole head before it sets the
            # row's quantization scale. (After RoPE, which it does not commute with; q and
            # k heads as one contiguous product: per-tensor products of the strided views
            # cost ~25x more.)
            t, qk_size = qkv.shape[0], (h + kvh) * d
            qk = apply_rope(qkv[:, :qk_size].view(t, h + kvh, d), cos, sin)
            qk = _rotate(qk.reshape(-1, d), r).view(t, h + kvh, d)
            v = _rotate(qkv[:, qk_size:].reshape(-1, d), r).view(t, kvh, d)
            q, k = qk[:, :h], qk[:, h:]
        if self.store_fn is None:
            store_kv(k, v, key_cache, value_cache, slot_mapping, has_skip_slots)
        else:
            self.store_fn(k, v, key_cache, value_cache, slot_mapping)
        return q, k, v

    def norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each head of q and of k RMS-normed (their own weights), v as it was."""
        t, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :h * d].reshape(t, h, d)).view(t, h * d)
        k = self.k_norm(qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d)).view(t, kvh * d)
        return torch.cat((q, k, qkv[:, (h + kvh) * d:]), dim=-1)

    def attend(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] against the cache (the step's k and v already stored) -> [T, H, D].
        The one part of a layer whose work depends on the batch's contexts: a piecewise
        graph runs it eagerly between its captured pieces."""
        return paged_attention(q, key_cache, value_cache, meta, self.scale, k, v, self.decode_fn,
                               self.prefill_fn, self.window, self.softcap)


def kernel_serves(kernel, attn: Attention) -> bool:
    """Whether an attention kernel implements the layer's options: a kernel lists the ones
    it takes in `kernel.options` ("window", "softcap"); a layer without options takes any."""
    if kernel is None:
        return True
    needs = {name for name, value in (("window", attn.window), ("softcap", attn.softcap))
             if value is not None}
    return needs <= set(getattr(kernel, "options", ()))


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ r [D, D] (fp32), in x's dtype: bf16 values are rotated in fp32."""
    return x @ r if x.dtype == r.dtype else (x.float() @ r).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.activation = spec.activation
        # gate_up [T, 2I] -> act(gate) * up [T, I]; or a fused kernel (set_fused_kernels)
        self.act_fn = GATED_ACTIVATIONS[spec.activation]
        self.lora_gate_up = None     # LoRA deltas (see Attention.lora_qkv)
        self.lora_down = None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        if lora is None or self.lora_gate_up is None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        y = self.act_fn(self.lora_gate_up(x, self.gate_up_proj(x), lora))
        return self.lora_down(y, self.down_proj(y), lora)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.self_attn = Attention(spec, layer)
        self.mlp = MLP(spec)
        self.input_layernorm = rms_norm(spec, spec.hidden_size)
        self.post_attention_layernorm = rms_norm(spec, spec.hidden_size)   # before the MLP
        # Gemma's sandwich: each sublayer's output normed before it joins the residual.
        self.attn_output_norm = rms_norm(spec, spec.hidden_size) if spec.sandwich_norms else None
        self.mlp_output_norm = rms_norm(spec, spec.hidden_size) if spec.sandwich_norms else None


def decoder_layer_step(layer: DecoderLayer, m: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       meta: AttentionMetadata, add_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on the residual stream `h`, given the previous layer's MLP output
    `m` (zeros before the first layer). Each residual add is fused into the norm after it.
    Returns (this layer's MLP output, the residual stream before it is added). Tensor code
    only and the same for every layer: a compiled CPU decode program compiles it once per
    batch size and runs it for all layers (graphs/cpu_compile.py)."""
    x, h = add_norm(m, h, layer.input_layernorm)
    a = layer.self_attn(x, cos, sin, key_cache, value_cache, meta)
    if layer.attn_output_norm is not None:
        a = layer.attn_output_norm(a)
    x, h = add_norm(a, h, layer.post_attention_layernorm)
    return mlp_output(layer, layer.mlp(x, meta.lora)), h


def mlp_output(layer: DecoderLayer, m: torch.Tensor) -> torch.Tensor:
    """What the MLP adds to the residual stream (Gemma: normed first)."""
    return m if layer.mlp_output_norm is None else layer.mlp_output_norm(m)


def layer_before_attention(layer: DecoderLayer, m: torch.Tensor, h: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           add_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """`decoder_layer_step` up to attention: (q [T, H, D], the residual stream), with this
    layer's k and v stored. Shape-static (padded slots are -1), so it can be captured."""
    x, h = add_norm(m, h, layer.input_layernorm)
    q, _, _ = layer.self_attn.project(x, cos, sin, key_cache, value_cache, slot_mapping, True)
    return q, h


def layer_after_attention(layer: DecoderLayer, o: torch.Tensor, h: torch.Tensor,
                          add_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """`decoder_layer_step` from attention's output o [T, H * D]: (MLP output, residual)."""
    attn = layer.self_attn
    if attn.kv_rotation is not None:
        o = attn.unrotate(o.view(o.shape[0], -1, attn.head_dim)).reshape(o.shape)
    a = attn.o_proj(o)
    if layer.attn_output_norm is not None:
        a = layer.attn_output_norm(a)
    x, h = add_norm(a, h, layer.post_attention_layernorm)
    return mlp_output(layer, layer.mlp(x)), h


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = rms_norm(spec, spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Built by init_rope() on the real device; rope_local: the sliding-window layers'
        # own table (Gemma 3), else None.
        self.rope: RotaryEmbedding | None = None
        self.rope_local: RotaryEmbedding | None = None
        self.window = spec.sliding_window if spec.has_sliding_layers else None
        # Layers of one attention type share block tables (actors/kv/groups.py).
        self.kv_groups = KVGroups.plan([spec.window(i) for i in range(spec.num_layers)])
        for layer, group in zip(self.layers, self.kv_groups.layer_group):
            layer.self_attn.kv_group = group
        self._layer_params: int | None = None     # counted at the first forward
        self._layout_done = False                 # see _use_cpu_weight_layout
        # (x, residual, norm) -> (norm(residual + x), residual + x); see set_fused_kernels.
        self.add_norm_fn = add_rms_norm
        self._norm_fn = None   # None: RMSNorm modules; else a fused rms_norm kernel
        # Where the CPU kernel choice per batch size is remembered (None: measured each start).
        self.plan_cache_dir = None
        # CPU decode steps in one C++ call (kernels/cpu/decode_stack.py); None: off.
        self.decode_stacks = None

    def use_one_kv_table(self) -> None:
        """Every layer in one group that keeps the whole context (cache.hybrid_kv false):
        the sliding layers still attend to their windows only, through masks."""
        self.kv_groups = KVGroups.single(self.spec.num_layers)
        for layer in self.layers:
            layer.self_attn.kv_group = 0

    def init_rope(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        spec = self.spec
        self.rope = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, dtype).to(device)
        if any(layer.self_attn.local_rope for layer in self.layers):
            self.rope_local = RotaryEmbedding(spec.rope_local, spec.head_dim, max_positions,
                                              dtype).to(device)

    def set_decode_kernel(self, decode_fn) -> None:
        """Route decode attention through `decode_fn` (same contract as decode_attention)
        in every layer whose options it implements (`kernel_serves`); the others keep the
        torch reference."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.decode_fn = decode_fn if kernel_serves(decode_fn, attn) else None

    def set_prefill_kernel(self, prefill_fn) -> None:
        """Route prefill-chunk attention through `prefill_fn(q [n, H, D], k, v [KVH, ctx,
        D], scale)` (causal, query i at position ctx - n + i; a `prefill_fn.paged` form
        reads the context through the block table) in every layer whose options it
        implements; None (and the other layers): torch SDPA."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.prefill_fn = prefill_fn if kernel_serves(prefill_fn, attn) else None

    def set_kv_check(self, check) -> None:
        """Route every layer's K/V and query through the runtime KV quality check (None:
        off). Eager forwards only: a captured graph or compiled program runs without it."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_check = check
            layer.self_attn.layer_index = i

    def set_kv_rotation(self, rotation: torch.Tensor | None) -> None:
        """Rotate q, k and v of every layer by `rotation` (cache.kv_rotation; None: off)."""
        back = None if rotation is None else rotation.T.contiguous()
        for layer in self.layers:
            layer.self_attn.kv_rotation = rotation
            layer.self_attn.kv_unrotation = back

    def enable_lora(self, stacks, kernel=None) -> None:
        """Give every projection its LoRA delta over `stacks`' resident slots
        (kernels/lora/stacks.LoRAStacks); `kernel`: the CUDA delta kernel (None: torch)."""
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.lora_qkv, attn.lora_o = stacks.delta(i, "qkv"), stacks.delta(i, "o")
            mlp.lora_gate_up, mlp.lora_down = stacks.delta(i, "gate_up"), stacks.delta(i, "down")
            for d in (attn.lora_qkv, attn.lora_o, mlp.lora_gate_up, mlp.lora_down):
                d.kernel = kernel

    def set_kv_store_kernel(self, store_fn) -> None:
        """Route the KV store through `store_fn(key, value, key_cache, value_cache, slots)`,
        which must skip slots < 0 without a host sync (what a captured graph needs)."""
        for layer in self.layers:
            layer.self_attn.store_fn = store_fn

    def set_fused_kernels(self, rms_norm_fn, silu_mul_fn, rope_store_fn) -> None:
        """Route the layer's small ops through fused kernels (triton_fused's contracts):
        `rms_norm_fn(x, weight, eps, residual=None)` (residual updated in place),
        `silu_mul_fn(gate_up)` and `rope_store_fn(qkv, cos, sin, H, KVH, D, key_cache,
        value_cache, slots)`, which also replaces the KV store. None restores the torch
        reference for that op."""
        if self.spec.norm_offset and self.embed_tokens.weight.dtype != torch.float32:
            rms_norm_fn = None   # (the kernels scale in the model dtype, Gemma in fp32)
        if rms_norm_fn is None:
            self.add_norm_fn = add_rms_norm
        else:
            def add_norm(x, residual, norm):
                return rms_norm_fn(x, norm.weight, norm.eps, residual), residual
            self.add_norm_fn = add_norm
        self._norm_fn = rms_norm_fn
        partial = self.spec.rope.rotary_dim not in (0, self.spec.head_dim)
        for layer in self.layers:
            if layer.mlp.activation == "silu":
                layer.mlp.act_fn = silu_mul_fn or GATED_ACTIVATIONS["silu"]
            # (the fused kernel rotates whole heads)
            layer.self_attn.rope_store_fn = None if partial else rope_store_fn

    def _norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        fn = self._norm_fn
        return norm(x) if fn is None else fn(x, norm.weight, norm.eps)

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> logits [len(logits_indices), vocab] (fp32).

        Only the rows that will be sampled go through the LM head: for a prefill chunk
        that is its last token, if the chunk completes the prompt.
        """
        return self.logits(self.forward_hidden(input_ids, positions, kv, meta), logits_indices)

    @torch.inference_mode()
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The step's residual stream after the last layer, [T, hidden]: `logits` turns any
        rows of it into logits (prompt logprobs need more rows than the sampled ones)."""
        self.prepare()
        if self.layers[0].self_attn.prefill_fn is None or self.window is not None:
            # once, not per layer (a kernel needs no mask)
            meta = with_chunk_masks(meta, self.embed_tokens.weight.dtype, self.window)
        with self.layer_threads(input_ids, meta):
            stacks = self.decode_stacks
            if stacks is not None and stacks.usable(meta, kv):
                stack = stacks.for_rows(input_ids.shape[0])
                if stack is not None:
                    return stacks.run(stack, input_ids, positions, kv, meta)
            return self.hidden_states(input_ids, positions, kv, meta)

    def prepare(self) -> None:
        """One-time set-up before the first forward (the CPU kernels per batch size)."""
        if not self._layout_done:
            self._use_cpu_weight_layout()

    @contextlib.contextmanager
    def layer_threads(self, input_ids: torch.Tensor, meta: AttentionMetadata):
        """Run the decoder layers of a small step on one thread (see ONE_THREAD_LAYER_*)."""
        threads = torch.get_num_threads()
        narrow = (threads > 1 and input_ids.device.type == "cpu"
                  and self._layer_work(input_ids.shape[0], meta) < ONE_THREAD_LAYER_WORK)
        if narrow:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if narrow:
                torch.set_num_threads(threads)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last decoder layer, [T, hidden]. Tensor code only
        (no host-side state), so a static-shape decode program can compile it."""
        h = self.embed(input_ids)                                       # [T, hidden]
        ropes = self.rope_lookup(positions if meta.rope_rows is None else meta.rope_rows)
        m = torch.zeros_like(h)   # h + 0 == h: the first layer's input norm sees h as is
        metas = (meta, *meta.group_metas) if meta.group_metas else None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            cos, sin = ropes[attn.local_rope]
            m, h = decoder_layer_step(layer, m, h, cos, sin, kv.key[i], kv.value[i],
                                      meta if metas is None else metas[attn.kv_group],
                                      self.add_norm_fn)
        return h + m

    def rope_lookup(self, rows: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(cos, sin) [T, 1, rotary] of the step's table rows, for the global layers and
        (index 1, `Attention.local_rope`) the local ones — once per step, not per layer."""
        cos_sin = self.rope.lookup(rows)
        return cos_sin, (self.rope_local.lookup(rows) if self.rope_local is not None
                         else cos_sin)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (Gemma: times sqrt(hidden), rounded to the model dtype
        first, as transformers does)."""
        h = self.embed_tokens(input_ids)
        mult = self.spec.embedding_multiplier
        if mult == 1.0:
            return h
        return h * torch.tensor(mult, dtype=h.dtype, device=h.device)

    def logits(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits (fp32) from the last residual stream (soft-capped where
        the family caps them)."""
        logits = self.lm_head(self._norm(h[logits_indices], self.norm)).float()
        cap = self.spec.final_logit_softcap
        return logits if cap is None else softcap(logits, cap)

    def _use_cpu_weight_layout(self) -> None:
        """On CPU, every projection and the LM head get the kernel that measures fastest on
        this machine for each band of batch sizes (kernel_plan.plan): MKL, oneDNN with a
        prepacked weight, or the C++ small-batch kernel. Same values; the sums may round
        differently in the last bit, as they do between batch sizes."""
        self._layout_done = True
        w = self.layers[0].self_attn.qkv_proj.weight
        if w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16):
            self.specialize_cpu("float")

    def specialize_cpu(self, storage: str = "float",
                       blocks: dict | None = None) -> dict[str, str]:
        """Replace the projections and the head by CpuLinear modules ("float": weights kept
        in the model dtype; "int8": weight-only int8, per-channel scales; "q4": 32-weight
        Q4_1-style blocks, the head in q8; "q8": Q8_0-style blocks), each with the kernel
        per batch-size band measured fastest here. `blocks`: q4/q8 blocks per module name
        to use as they are (a GGUF file's own, kernels/models/gguf_blocks.py). Returns what
        was chosen."""
        self._layout_done = True
        self._count_layer_params()   # before the weights leave the parameters
        act = self.rope.cos.dtype if self.rope is not None else self.embed_tokens.weight.dtype
        blocks = blocks or {}
        head_storage = kernel_set.Q8 if storage == kernel_set.Q4 else storage
        excluded = self._copy_kernels_excluded(storage)
        first = self.layers[0]
        names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        linears = [first.get_submodule(n) for n in names]
        # Whether a decode step streams the weights from memory (the planner then times
        # decode-sized calls with the caches flushed) or finds them in the cache.
        streamed = (sum(lin.weight.numel() for lin in linears) * len(self.layers)
                    * kernel_plan.weight_bytes_per_element(storage, act))
        from_memory = streamed > kernel_plan.last_level_cache_bytes()
        layer_plan = kernel_plan.cached_plan(
            [(lin.weight, lin.bias) for lin in linears], storage, act,
            cache_dir=self.plan_cache_dir, excluded=excluded,
            blocks=[blocks.get(f"layers.0.{n}") for n in names], from_memory=from_memory)
        head_plan = kernel_plan.cached_plan([(self.lm_head.weight, None)], head_storage, act,
                                            kernel_set.HEAD_ROW_LADDER,
                                            cache_dir=self.plan_cache_dir, excluded=excluded,
                                            blocks=[blocks.get("lm_head")],
                                            from_memory=from_memory)
        from tokenloom.kernels.cpu.allocator import huge_page_bytes, weight_arena
        # The arena counts every byte it ever placed (the plans' trial copies too, and other
        # models in this process): this model's weights are what is placed from here.
        placed_before = weight_arena().placed_bytes
        for i, layer in enumerate(self.layers):
            for n in names:
                parent, attr = n.split(".")
                owner = getattr(layer, parent)
                lin = getattr(owner, attr)
                setattr(owner, attr, cpu_linear.CpuLinear(
                    lin.weight, lin.bias, storage, act, layer_plan,
                    blocks=blocks.get(f"layers.{i}.{n}")))
        # A tied head keeps the embedding for lookups (one row a token) and gets its own
        # copy in the head's storage; in the model's own dtype ("float") that copy is the
        # embedding's weight moved to huge-page memory (kernels/cpu/allocator.py), and the
        # embedding then looks its rows up there: one copy, as before.
        tied = self.lm_head.weight.data_ptr() == self.embed_tokens.weight.data_ptr()
        self.lm_head = cpu_linear.CpuLinear(self.lm_head.weight, None, head_storage, act,
                                            head_plan, blocks=blocks.get("lm_head"))
        moved = getattr(self.lm_head.kernels, "w", None)
        if (tied and storage == "float" and moved is not None
                and moved.dtype == self.embed_tokens.weight.dtype
                and moved.shape == self.embed_tokens.weight.shape):
            self.embed_tokens.weight = nn.Parameter(moved, requires_grad=False)
        # The weights' old memory: freed, and handed back rather than kept for reuse.
        from tokenloom.kernels.cpu.allocator import release_freed_memory
        release_freed_memory()
        chosen = {"layers": layer_plan.describe(), "head": head_plan.describe()}
        self.cpu_kernels = chosen   # part of a compiled program's cache key
        self.cpu_weights_placed_bytes = weight_arena().placed_bytes - placed_before
        placed, huge = self.cpu_weights_placed_bytes >> 20, huge_page_bytes() >> 20
        startup_log.info(f"CPU projections ({storage} weights, "
                         f"{str(act).removeprefix('torch.')} activations): "
                         f"layers {chosen['layers']}; head {chosen['head']}; "
                         f"{placed} MiB of weights placed for huge pages, {huge} MiB of the "
                         f"process on huge pages", storage=storage, weights_placed_mib=placed,
                         huge_pages_mib=huge, **chosen)
        return chosen

    def _copy_kernels_excluded(self, storage: str) -> frozenset:
        """int8/q4/q8 may keep a dequantized copy for prefill-sized calls, and bf16
        activations an fp32 copy (copy_fp32), where memory allows: the copies must fit in
        half of the memory available now; otherwise the fp32 copy goes first, then every
        copy, and those row counts run the model's own kernels."""
        import os

        act = self.rope.cos.dtype if self.rope is not None else self.embed_tokens.weight.dtype
        quantized = storage in (*kernel_set.BLOCK_STORAGES, kernel_set.INT8)
        fp32_copy = act == torch.bfloat16
        if not quantized and not fp32_copy:
            return frozenset()
        params = sum(p.numel() for layer in self.layers for p in layer.parameters())
        params += self.lm_head.weight.numel()
        act_copy = params * torch.tensor([], dtype=act).element_size() if quantized else 0
        wide_copy = params * 4 if fp32_copy else 0
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 0
        if act_copy + wide_copy <= available // 2:
            return frozenset()
        if fp32_copy and act_copy <= available // 2:
            startup_log.info(f"{storage}: no fp32 copy for prefill (memory)",
                             copy_mb=wide_copy >> 20, available_mb=available >> 20)
            return frozenset({"copy_fp32"})
        startup_log.info(f"{storage}: no dequantized copies for prefill (memory)",
                         copy_mb=(act_copy + wide_copy) >> 20, available_mb=available >> 20)
        return frozenset(kernel_set.COPY_KERNELS)

    def _count_layer_params(self) -> None:
        params = list(self.layers[0].parameters())
        nbytes = sum(p.numel() * p.element_size() for p in params)
        # Layers too large to ever run on one thread count as infinite work.
        self._layer_params = (sum(p.numel() for p in params)
                              if nbytes < ONE_THREAD_LAYER_BYTES else ONE_THREAD_LAYER_WORK)

    def _layer_work(self, num_tokens: int, meta: AttentionMetadata) -> int:
        """Multiply-adds of one decoder layer for this batch (projections and attention)."""
        if self._layer_params is None:
            self._count_layer_params()
        keys = meta.num_decodes * meta.decode_max_context + sum(
            s.query_len * s.context_len for s in meta.prefills)
        return num_tokens * self._layer_params + 2 * keys * self.spec.q_size
