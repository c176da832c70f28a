"""Memory planning from config.json and safetensors headers alone (no weights read): what a
run holds at its peak, which the choice of placement (:mod:`.placement`) and ``--plan``'s
text (:mod:`.plan_text`) are made of.

The seeds' formulas (for one forward of ``batch`` x ``seq`` tokens)::

    activations = batch * seq * hidden * num_layers * bytes(dtype)
    kv_cache    = 2 * batch * num_layers * seq * num_kv_heads * head_dim * bytes(dtype)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model.build import LAYER_LIST_CANDIDATES, hidden_size_from_config
from ..model.checkpoint import Checkpoint, split_by_conversion
from ..model.source import ModelSource, checkpoint_conversions
from ..model.streaming import ROW_BLOCK_FRACTION
from ..noise.batching import PAST_SHARE, samples_per_forward
from ..noise.rounding import ROUNDING_BLOCK
from ..noise.tokens import block_rows
from ..noise.wider import WIDEN_BLOCK, query_block
from ..store.tensorfile import SAFETENSORS_ITEMSIZE, SAFETENSORS_TORCH_DTYPE

# -- checkpoint sizes from headers -------------------------------------------------------------


@dataclass
class CheckpointSizes:
    by_dtype: dict[str, int] = field(default_factory=dict)  # bytes on disk per stored dtype
    numel: dict[str, int] = field(default_factory=dict)  # per tensor
    ndim: dict[str, int] = field(default_factory=dict)  # per tensor
    dtype: dict[str, str] = field(default_factory=dict)  # per tensor, as safetensors names it


def checkpoint_sizes(checkpoint: Checkpoint) -> CheckpointSizes:
    sizes = CheckpointSizes()
    for name in sorted(set(checkpoint.weight_map.values())):
        for key, info in checkpoint.shard_header(name)[0].items():
            n = 1
            for dim in info["shape"]:
                n *= dim
            sizes.numel[key] = n
            sizes.ndim[key] = len(info["shape"])
            sizes.dtype[key] = info["dtype"]
            nbytes = n * SAFETENSORS_ITEMSIZE.get(info["dtype"], 4)
            sizes.by_dtype[info["dtype"]] = sizes.by_dtype.get(info["dtype"], 0) + nbytes
    return sizes


def itemsize(dtype_name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype_name]


def wider_itemsize(itemsize_: int) -> int:
    """Bytes of an element one precision wider (the floor's dtype, a perturbed op's wider
    result): float32 for 16-bit, float64 for float32 (``floor.floor_dtype``)."""
    return 8 if itemsize_ == 4 else 4


@dataclass
class Plan:
    weights: int
    largest_layer: tuple[int, int]
    non_layer: int
    activations: int
    kv_cache: int
    by_dtype: dict[str, int]
    #: The most a unit outside the layers holds at once, in the run dtype: a matrix (embeddings,
    #: head) is read by rows, at most a block of ROW_BLOCK_FRACTION of the largest layer; any
    #: other tensor whole.
    largest_outside: int = 0
    logits: int = 0  # one set of the model's logits over the prompt, in the run dtype
    kv_layer: int = 0  # one layer's share of kv_cache
    resident: int = 0  # tied embeddings and head: read whole once, held through the forward
    #: What loading the largest layer holds at its peak beyond the layer itself, in the run
    #: dtype (:func:`load_peak`): transformers' loader stacks experts stored one by one.
    load_extra: int = 0


def attention_shape(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden size, attention heads, key/value heads, head dim) from config.json."""
    text = cfg.get("text_config") or cfg
    hidden = hidden_size_from_config(cfg) or 0
    heads = text.get("num_attention_heads") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if heads else 0)
    return hidden, heads, kv_heads, head_dim


def make_plan(model: ModelSource, dtype_name: str, batch: int, seq: int) -> Plan:
    cfg = model.config_json
    text = cfg.get("text_config") or cfg
    size = itemsize(dtype_name)
    sizes = checkpoint_sizes(model.checkpoint)
    layer_path = model.layer_module or _guess_layer_path(model.checkpoint)
    num_layers = model.num_layers
    per_layer = []
    layer_keys = []
    claimed = set()
    for i in range(num_layers):
        keys = model.checkpoint.layer_keys(layer_path, i)
        claimed.update(keys)
        layer_keys.append(keys)
        per_layer.append(sum(sizes.numel.get(k, 0) for k in keys) * size)
    total = sum(sizes.numel.values()) * size
    non_layer = sum(n for k, n in sizes.numel.items() if k not in claimed) * size
    largest = max(range(num_layers), key=lambda i: per_layer[i]) if per_layer else 0
    load_extra = 0
    if per_layer:
        groups = split_by_conversion(checkpoint_conversions(model), layer_keys[largest])
        load_extra = load_peak(groups, sizes, dtype_name) - per_layer[largest]
    hidden, _, kv_heads, head_dim = attention_shape(cfg)
    activations = batch * seq * hidden * num_layers * size
    kv = 2 * batch * num_layers * seq * kv_heads * head_dim * size
    outside = [k for k in sizes.numel if k not in claimed]
    matrices = max((sizes.numel[k] for k in outside if sizes.ndim[k] == 2), default=0)
    others = max((sizes.numel[k] for k in outside if sizes.ndim[k] != 2), default=0)
    largest_numel = per_layer[largest] // size if per_layer else 0
    tied = _tied(model)
    by_rows = 0 if tied else min(matrices, max(int(ROW_BLOCK_FRACTION * largest_numel), 1))
    vocab = text.get("vocab_size") or 0
    return Plan(
        total,
        (largest, per_layer[largest] if per_layer else 0),
        non_layer,
        activations,
        kv,
        sizes.by_dtype,
        largest_outside=max(others, by_rows) * size,
        logits=batch * seq * vocab * size,
        kv_layer=kv // num_layers if num_layers else 0,
        resident=matrices * size if tied else 0,
        load_extra=load_extra,
    )


def load_peak(groups: list[tuple[Any, list[str]]], sizes: CheckpointSizes, dtype_name: str) -> int:
    """The most loading a layer holds at once, in bytes of the run dtype, as
    :meth:`Checkpoint.load_into` loads it: one conversion group at a time, the largest first
    (``groups``: :func:`split_by_conversion`). The sources are maps of the shards (not the
    process's memory) unless stored in another dtype, when the loader converts each as it
    reads it; a converter's operations each make a new tensor beside their input
    (``MergeModulelist`` the stack of every expert's tensors of a kind, ``Concatenate`` the
    fused parameter), so with two or more the last one's input and output are held together:
    a group holds its size once per live copy, and the groups before it beside it."""
    size = itemsize(dtype_name)
    costs = []
    for converter, keys in groups:
        nbytes = sum(sizes.numel.get(k, 0) for k in keys) * size
        # a tensor stored in another dtype is converted as it is read
        converted = any(k in sizes.dtype and SAFETENSORS_TORCH_DTYPE.get(sizes.dtype[k]) != dtype_name for k in keys)
        operations = len(getattr(converter, "operations", None) or ())  # none for the unconverted group
        costs.append((nbytes, max(min(operations, 2) + converted, 1)))
    held = peak = 0
    for nbytes, copies in sorted(costs, key=lambda c: -c[0]):
        peak = max(peak, held + copies * nbytes)
        held += nbytes
    return peak


def _tied(model: ModelSource) -> bool:
    """Whether the model ties its embeddings and head (streaming then holds them whole)."""
    text = model.config_json.get("text_config") or {}
    for scope in (text, model.config_json):
        if "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"])
    try:
        return bool(getattr(model.hf_config, "tie_word_embeddings", False))
    except Exception:  # a config transformers cannot read here: its default
        return False


@dataclass(frozen=True)
class RunOptions:
    """What of a run changes its memory beside the model and the inputs."""

    attn_implementation: str | None = None  # None: the library's default (sdpa)
    precision_floor: bool = True
    envelope: bool = True
    envelope_samples: int = 12  # K: a short call's runs go through the layer together
    decode_steps: int = 0
    logits_mapped: bool = False  # the prompt's logits in a file-backed map (streaming on the CPU)


def layer_activations(
    cfg: dict[str, Any], batch: int, seq: int, itemsize_: int, eager_attention: bool, wider_pass: bool = False
) -> int:
    """Bytes of the tensors one decoder layer's forward holds at its widest point, for
    ``batch`` x ``seq`` tokens in a dtype of ``itemsize_`` bytes: the residual stream and its
    normed copy, the attention's queries, keys, values (and their rotated copies) and output,
    the attention scores with their float32 softmax under eager attention (sdpa on the CPU
    works in blocks), and the MLP's widest intermediates (:func:`mlp_activations`)."""
    tokens = batch * seq
    hidden, heads, kv_heads, head_dim = attention_shape(cfg)
    q, kv = tokens * heads * head_dim, tokens * kv_heads * head_dim
    attention = (2 * q + 4 * kv) * itemsize_ + q * itemsize_
    if eager_attention:
        attention += batch * heads * seq * seq * (itemsize_ + 4)
    return 4 * tokens * hidden * itemsize_ + attention + mlp_activations(cfg, batch, seq, itemsize_, wider_pass)


def mlp_activations(cfg: dict[str, Any], batch: int, seq: int, itemsize_: int, wider_pass: bool = False) -> int:
    """Bytes of the MLP's widest intermediates (its input aside) for ``batch`` x ``seq``
    tokens in a dtype of ``itemsize_`` bytes. A dense MLP: its gate, up and activated
    intermediates. A mixture of experts: the more of its up projection's (each token's
    top-k experts' inputs, gate, up and activated intermediates) and its end's (transformers'
    grouped experts: the routed inputs, the down projection's outputs, and those weighted by
    the router's weights and put back in token order, float32 where the weights are), and the
    router's float32 scores. With ``wider_pass``, as the precision floor's and the
    envelope's passes run the layer: the experts one at a time (one expert's share of the
    tokens, and the output they add into), a dense MLP over blocks of tokens
    (``tokens.in_token_blocks``: one block's intermediates, and the output they are written
    into)."""
    text = cfg.get("text_config") or cfg
    tokens = batch * seq
    hidden = attention_shape(cfg)[0]
    experts, top_k, inter = mlp_sizes(text)
    if experts:
        routed = tokens * top_k // experts if wider_pass else tokens * top_k
        # the experts' up projection: the routed inputs, their gate and up outputs, activated
        mlp = routed * (3 * inter + hidden) * itemsize_
        if wider_pass:
            mlp += tokens * hidden * itemsize_
        else:
            # the end: most routers keep their softmax's float32 weights, which widen the
            # weighted outputs (an over-count of two 16-bit copies where a router casts back)
            mlp = max(mlp, routed * hidden * (2 * itemsize_ + 2 * max(itemsize_, 4)))
        mlp += tokens * experts * 4
    else:
        block = blocked_tokens(batch, seq, max(inter, hidden)) if wider_pass else tokens
        mlp = 3 * block * inter * itemsize_ + (tokens * hidden * itemsize_ if block < tokens else 0)
    return mlp


def blocked_tokens(batch: int, seq: int, width: int) -> int:
    """Tokens in one block of a per-token module whose widest intermediate is ``width``
    wide, run over blocks (``tokens.block_rows``)."""
    return batch * min(seq, block_rows((batch, seq, width), width))


def mlp_sizes(text: dict[str, Any]) -> tuple[int, int, int]:
    """(experts, experts per token, intermediate size): an expert's for a mixture of
    experts, the MLP's for a dense one (experts 0)."""
    experts = text.get("num_local_experts") or text.get("num_experts") or text.get("n_routed_experts") or 0
    if not experts:
        return 0, 1, text.get("intermediate_size") or 0
    top_k = text.get("num_experts_per_tok") or text.get("top_k") or 1
    inter = text.get("moe_intermediate_size") or text.get("intermediate_size") or 0
    return experts, top_k, inter


def widest_weight(cfg: dict[str, Any]) -> int:
    """Elements of the largest weight one op of a decoder layer reads (an attention
    projection, the dense MLP's up projection, or one expert's gate and up projections:
    transformers stacks them into one tensor, and one expert's slice is what an op reads)
    that a pass one precision wider widens at once: for the op alone, and a block of its
    columns at a time where it has more than ``wider.WIDEN_BLOCK`` elements."""
    text = cfg.get("text_config") or cfg
    hidden, heads, _, head_dim = attention_shape(cfg)
    experts, _, inter = mlp_sizes(text)
    mlp = (2 if experts else 1) * inter * hidden
    return min(max(heads * head_dim * hidden, mlp), WIDEN_BLOCK)


def perturbed_op_peak(cfg: dict[str, Any], batch: int, seq: int, itemsize_: int, eager_attention: bool) -> int:
    """Bytes one op of a perturbed run (``perturb.PerturbedArithmetic``) adds at its widest,
    beyond the run's own tensors: its result computed one precision wider (beside its
    widened input, then beside the result and the rounded result), and the rounding's error,
    point and mask for one block (``rounding.ROUNDING_BLOCK``), for the largest result
    of the layer: the norms' float32 pass over a block of tokens' hidden states (float64
    wide), the MLP's intermediate (a block of tokens'; for a mixture of experts: one
    expert's gate and up outputs, its share of the tokens), eager attention's float32
    softmax; and a fused attention's wider reference, the math attention (its queries, keys
    and values widened, its output, and one block of queries' scores and probabilities:
    ``wider.attention_reference``)."""
    text = cfg.get("text_config") or cfg
    tokens = batch * seq
    hidden, heads, kv_heads, head_dim = attention_shape(cfg)
    wide = wider_itemsize(itemsize_)

    def op(elements: int, size: int, wider: int) -> int:
        # the wider result beside its widened input, then beside the result and the rounded
        # result; the rounding's own temporaries (error, point, mask) for one block of it
        whole = max(2 * elements * wider, elements * (wider + 2 * size))
        return whole + min(elements, ROUNDING_BLOCK) * (3 * wider + size + 1)

    experts, top_k, inter = mlp_sizes(text)
    # the norms and a dense MLP run over blocks of tokens (tokens.in_token_blocks)
    mlp = tokens * top_k * 2 * inter // experts if experts else blocked_tokens(batch, seq, max(inter, hidden)) * inter
    candidates = [op(blocked_tokens(batch, seq, hidden) * hidden, 4, 8), op(mlp, itemsize_, wide)]
    q, kv = tokens * heads * head_dim, tokens * kv_heads * head_dim
    if eager_attention:
        candidates.append(op(batch * heads * seq * seq, 4, 8))
    else:
        scores = 2 * batch * heads * query_block(seq, head_dim, seq) * seq * wide
        candidates.append((3 * q + 2 * kv) * wide + scores)
    return max(candidates) + widest_weight(cfg) * wide


#: What a streaming extraction holds beside the tensors the plan counts, whatever the model's
#: size: the allocator's free lists and its threads' heaps, Python objects, kernels' caches.
#: Measured, not fitted: bench/bench_plan.py's ``fixed`` column (a run's peak above its
#: tensors, on a miniature of the architecture: hidden size 64) for MiniMax-M2 (the plan's
#: calibration model) at seq 128, 10.1 MB; the other architectures' are reported beside it.
RUN_OVERHEAD = 10 * 10**6

LOAD_OR_ACTIVATIONS = "loading it, or one unit's activations (a layer's, or the head's: the prompt's logits) where more"
KV_ONE_LAYER = "one layer's KV cache (decode steps; the other layers' on disk)"
LOAD_OR_WIDEST = "loading it, or one layer's activations (the widest pass: the floor's or the envelope's) where more"
FORWARD = "the reference forward"
GOLDENS = "each layer's goldens"
FLOOR_OUTPUT = "the floor's output (the envelope's runs are held against it)"
BRANCH_OUTPUTS = "the directions branch_bias is measured along (the branches', two of arithmetic; golden's dtype)"
#: Branches of a decoder layer the plan counts (``noise.wide_pass.capture_branches``): its
#: attention and its MLP or mixture of experts, kept in the floor's dtype through its pass.
BRANCHES = 2
#: The directions a golden stores: the branches', the attention temperature's and the norms'
#: epsilon's (``noise.directions``: each pass of its own holds one output beside the
#: floor's, less than the branches the first pass holds).
DIRECTIONS = BRANCHES + 2
RUN_OUTPUT = "the output of the perturbed runs that go together (their statistics taken, they go)"


def stream_extraction_needs(
    plan: Plan, cfg: dict[str, Any], dtype_name: str, batch: int, seq: int, options: RunOptions
) -> tuple[str, dict[str, int]]:
    """What streaming extraction holds at its peak (bytes; code aside), and in which of its
    two phases, the larger:

    * the reference forward (every unit streamed, then the decode steps): the largest unit (a
      decoder layer, or a block of the embeddings' or head's rows; tied ones whole, held
      through the forward) in the run dtype, and beside it the more of
      what loading it adds (the tensors read and converted, at most about one more unit:
      ``Checkpoint.load_into`` converts one group at a time, the largest first) or one
      unit's activations (they do not coexist with a load): a layer's, or the head's, the
      prompt's logits (they go to disk as the forward returns; the decode steps' pass over
      the prompt keeps its last position's alone); while the decode steps run, one layer's
      KV cache (the others' on disk, as the layers' calls);
    * each layer's goldens (the layer loaded once for its precision floor and noise envelope;
      the prompt's logits are written before, from disk): the largest layer, and beside it
      the more of what loading it adds or the widest pass over it: the precision floor's
      (the layer's tensors in the floor dtype, float32 or float64, and the weight of one op
      widened for it) or a perturbed run's (the run's tensors in its dtype, and the widest
      op's work one precision wider: :func:`perturbed_op_peak`); one captured layer call
      (its hidden states in and out), read back to write its golden; the floor's output,
      which the envelope's runs are held against, and one run's output (each run's
      statistics are taken as it ends: K does not change the peak). On the CPU; on an
      accelerator the runs go together as many as its memory holds (more than planned).
    """
    size = itemsize(dtype_name)
    floor_size = wider_itemsize(size)
    eager = options.attn_implementation == "eager"
    act = layer_activations(cfg, batch, seq, size, eager)
    hidden = attention_shape(cfg)[0]
    unit = max(plan.largest_layer[1], plan.largest_outside)
    # the head's output, the prompt's logits, is a file-backed map where streaming runs on
    # the CPU (spill.mapped_empty): on disk as the kernel needs, not the process's memory
    logits = 0 if options.logits_mapped else plan.logits
    load = plan.load_extra if unit == plan.largest_layer[1] else unit  # a block of rows: read, converted
    forward = {
        "the largest unit": unit,
        LOAD_OR_ACTIVATIONS: max(load, act, logits),
        KV_ONE_LAYER: plan.kv_layer if options.decode_steps else 0,
        "tied embeddings and head (held through the forward)": plan.resident,
    }
    goldens = {"one captured call (hidden states in and out)": 2 * batch * seq * hidden * size}
    if options.precision_floor:  # the layer is loaded for its floor and envelope
        # the floor's pass: every result in the floor dtype, each op's weight widened for it, and
        # the branches' outputs it keeps
        output = batch * seq * hidden
        widest = layer_activations(cfg, batch, seq, floor_size, eager, True) + widest_weight(cfg) * floor_size
        widest += BRANCHES * output * floor_size
        held = {FLOOR_OUTPUT: output * floor_size, BRANCH_OUTPUTS: DIRECTIONS * output * size}
        if options.envelope:
            # the perturbed runs that go together on the CPU (batching.samples_per_forward), one
            # batch of them: its tensors in the run dtype, and one op's wider work at a time. On
            # an accelerator more go together, as many as its free memory holds beside this.
            runs = samples_per_forward(options.envelope_samples, batch * seq)
            perturbed = layer_activations(cfg, runs * batch, seq, size, eager, True) + perturbed_op_peak(
                cfg, runs * batch, seq, size, eager
            )
            if options.decode_steps:  # a decode step's runs together: each run's copy of the past
                past = batch * (seq + options.decode_steps) // PAST_SHARE
                steps = samples_per_forward(options.envelope_samples, batch + past)
                perturbed = max(perturbed, steps * plan.kv_layer)
            widest = max(widest, perturbed)
            held[RUN_OUTPUT] = runs * batch * seq * hidden * size
        layer = plan.largest_layer[1]
        goldens = {"the largest layer": layer, LOAD_OR_WIDEST: max(plan.load_extra, widest), **goldens, **held}
    return (FORWARD, forward) if sum(forward.values()) >= sum(goldens.values()) else (GOLDENS, goldens)


def _guess_layer_path(checkpoint: Checkpoint) -> str:
    keys = list(checkpoint.weight_map)
    for candidate in LAYER_LIST_CANDIDATES:
        if any(k.startswith(candidate + ".0.") for k in keys):
            return candidate
    return "model.layers"
