"""What the reference side can record of an architecture, decided from its config before any
work is done: a refusal names the reason and the way round it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from ..selection import layer_spec
from ..store.callspec import cache_argument
from ..store.kv_cache import EMPTY_CACHE_LAYER, UnstorableCache, check_storable

if TYPE_CHECKING:
    from ..model.source import ModelSource

#: Layer kinds (a config's ``layer_types``) without attention, which transformers gives an empty
#: cache entry: their decode step is their one-token call, with no cache to replay.
WITHOUT_ATTENTION = frozenset({"moe", "mlp"})


def check_decode_cache(model: ModelSource, layers: list[int], decode_steps: int) -> None:
    """Refuse decode steps where a selected layer's KV-cache entry, as transformers makes it for
    this config, holds state a decode-step golden cannot store (it stores keys and values, and
    linear attention's states: ``kv_cache.check_storable``), or is empty because the layer
    reads another layer's (KV sharing: an empty entry is taken only for a layer without
    attention, ``WITHOUT_ATTENTION``).
    A config transformers' cache cannot read is left to the recording, which checks each entry."""
    if not decode_steps:
        return
    from transformers.cache_utils import DynamicCache

    model_class = modeling_module(model)  # registers the cache entries the architecture defines for its layer types
    if model_class is not None and cache_argument(model_class.forward) is None:
        raise ModelError(
            f"--decode-steps {decode_steps}: {model_class.__name__}.forward takes no KV cache (no `cache` or "
            "`past_key_values` argument): a decode-step golden is a layer's call with the past keys and values "
            "of a transformers cache, which this model does not keep; extract with --decode-steps 0"
        )
    try:
        entries = DynamicCache(config=model.hf_config).layers
    except (AttributeError, KeyError, TypeError, ValueError):
        return
    try:
        kinds = list(getattr(model.hf_config.get_text_config(decoder=True), "layer_types", None) or [])
    except (AttributeError, TypeError, ValueError):
        kinds = []  # an empty entry is then refused: it may be a shared one
    for index in layers:
        if index < len(entries):
            try:
                check_storable(entries[index], index)
            except UnstorableCache as exc:
                raise ModelError(f"--decode-steps {decode_steps}: {exc}") from None
            if type(entries[index]).__name__ == EMPTY_CACHE_LAYER and (
                index >= len(kinds) or kinds[index] not in WITHOUT_ATTENTION
            ):
                raise ModelError(
                    f"--decode-steps {decode_steps}: layer {index} reads the keys and values another layer stores "
                    "(its own KV-cache entry is empty), which a decode-step golden of this layer cannot hold; extract "
                    "with --decode-steps 0 (the prompt tests and the whole model's prompt still run)"
                )


def modeling_module(model: ModelSource) -> Any:
    """Import the architecture's modeling module (a cache entry class it defines registers
    itself for its layer type when the module is imported); the causal-LM class transformers
    maps the config to, or None."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(model.hf_config)]
    except (KeyError, ImportError, AttributeError, ValueError):
        return None  # not a causal LM transformers maps: its remote code is imported when the model is made


def check_checkpoint_names(model: ModelSource, layers: list[int]) -> None:
    """Refuse a checkpoint with no tensors for the first selected layer under the model's names
    (or the names transformers renames to them as it loads): the plugin reads one layer's
    tensors at a time by those names, so every layer's test would fail the same way."""
    if not layers:
        return
    path = model.layer_list[0]
    if model.checkpoint.layer_keys(path, layers[0]):
        return
    names = model.checkpoint.weight_map
    example = next((k for k in names if f".{layers[0]}." in k), next(iter(names), "none"))
    raise ModelError(
        f"the checkpoint in {model.model_dir} has no tensors for layer {layers[0]} under the model's names "
        f"({path}.{layers[0]}.*; a key there: {example!r}) nor under names transformers renames to them: it was not "
        f"saved from {model_class_name(model)} (config.json's architectures and model_type say which class reads it)"
    )


def model_class_name(model: ModelSource) -> str:
    return ", ".join(model.config_json.get("architectures") or []) or str(model.config_json.get("model_type"))


def check_attention_mode(model: ModelSource, seq_len: int) -> None:
    """Refuse a model that switches its layers' attention by the input's length as it runs
    (BigBird: block-sparse attention in config.json, switched to full attention for a sequence
    of at most (5 + 2 x num_random_blocks) x block_size tokens): a layer built alone keeps the
    config's, so it would not compute what the model's layer did."""
    config = model.hf_config
    if getattr(config, "attention_type", None) != "block_sparse":
        return
    blocks, size = getattr(config, "num_random_blocks", 3), getattr(config, "block_size", 64)
    limit = (5 + 2 * blocks) * size
    how = (
        f"for --seq-len {seq_len} (at most {limit} tokens) the model switches its layers to full attention as it runs"
        if seq_len <= limit
        else "the model switches its layers to full attention for each decode step (one token) as it runs"
    )
    raise ModelError(
        f"{model_class_name(model)}: config.json's attention_type is block_sparse, and {how}: a layer built alone "
        "keeps block-sparse attention, so it would not compute what the model's layer did; test a copy of the "
        'checkpoint whose config.json says "attention_type": "original_full" (what the model runs a short prompt with)'
    )


def check_recurrent_depth(model: ModelSource, layers: list[int]) -> None:
    """Refuse selected layers the model runs more than once in one forward pass (a
    recurrent-depth model: its forward loops over a stretch of its layers several times), read
    from the forward of the module that holds the layer list: a loop over that list inside
    another loop. Each run is another computation on another input and cache entry, and a
    golden holds one call per layer. The layers it runs once are named for ``--layers``. The
    recording still refuses a layer that runs twice where the code does not show it."""
    path, found = model.layer_list
    attribute = path.rpartition(".")[2]
    found_loop = repeated_layers(model.layer_owner, attribute, len(found))
    if found_loop is None:
        return
    looped, loop = found_loop
    if not set(layers) & looped:
        return
    once = [i for i in range(len(found)) if i not in looped]
    ran = "--layers " + layer_spec(once) if once else None
    one = len(looped) == 1
    which = f"layer{'' if one else 's'} {layer_spec(sorted(looped))}"
    raise ModelError(
        f"{model_class_name(model)} runs decoder {which} of {path} more than once in one forward pass: "
        f"{type(model.layer_owner).__name__}.forward calls {'it' if one else 'them'} inside the loop `{loop}` (a "
        "recurrent-depth model); each run is another computation on another input and cache entry, and a golden "
        "holds one call per layer; "
        + (f"test the layers it runs once with {ran}" if ran else "no layer runs once: this model is not supported")
    )


class _Unknown(Exception):
    """A value the source does not give without running the model."""


def repeated_layers(owner: Any, attribute: str, count: int) -> tuple[set[int], str] | None:
    """Which of the ``count`` layers in ``owner.<attribute>`` its ``forward`` iterates over
    inside another ``for`` loop, with that outer loop's header; None where it does not (or its
    source cannot be read). The slice of the list is read from the forward's own assignments
    and ``self``'s attributes (``self.layers[start:end]`` with ``start = self.config.n_input_layers``);
    every layer where it cannot be."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    function = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None:
        return None
    assigned: dict[str, list[ast.expr]] = {}
    for node in _own_nodes(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned.setdefault(node.targets[0].id, []).append(node.value)
    names = {name: values[0] for name, values in assigned.items() if len(values) == 1}
    for outer, inner in _nested_loops(function):
        listed = _layer_list_use(inner.iter, attribute)
        if listed is None:
            continue
        header = f"for {ast.unparse(outer.target)} in {ast.unparse(outer.iter)}"
        try:
            bounds = slice(*(_value(part, names, owner) if part is not None else None for part in listed))
            looped = set(range(count)[bounds])
        except (_Unknown, TypeError, ValueError):
            looped = set(range(count))
        return looped, header
    return None


def _own_nodes(function: Any) -> Any:
    """The nodes of ``function``'s body, not those of functions defined in it."""
    import ast

    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _nested_loops(function: Any) -> Any:
    """(outer, inner) for each ``for`` loop of ``function`` inside another of its ``for`` loops."""
    import ast

    def visit(node: Any, enclosing: Any) -> Any:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, (ast.For, ast.AsyncFor)):
                if enclosing is not None:
                    yield enclosing, child
                yield from visit(child, enclosing if enclosing is not None else child)
            else:
                yield from visit(child, enclosing)

    yield from visit(function, None)


def _layer_list_use(node: Any, attribute: str) -> tuple[Any, Any, Any] | None:
    """(lower, upper, step) of the slice of ``self.<attribute>`` a loop header iterates over
    (all None for the whole list), or None where it does not use that list."""
    import ast

    for found in ast.walk(node):
        if isinstance(found, ast.Subscript) and _is_list(found.value, attribute):
            part = found.slice
            if isinstance(part, ast.Slice):
                return part.lower, part.upper, part.step
            return None if isinstance(part, ast.Constant) else (None, None, None)
        if _is_list(found, attribute):
            return None, None, None
    return None


def _is_list(node: Any, attribute: str) -> bool:
    import ast

    return (
        isinstance(node, ast.Attribute)
        and node.attr == attribute
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _value(node: Any, names: dict[str, Any], owner: Any, depth: int = 0) -> Any:
    """An expression of the forward evaluated from constants, ``self``'s attributes and the
    forward's single assignments; _Unknown where it needs more (an input, a call)."""
    import ast
    import operator

    operators = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
    if depth > 20:
        raise _Unknown
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id == "self":
            return owner
        if node.id not in names:
            raise _Unknown
        return _value(names[node.id], names, owner, depth + 1)
    if isinstance(node, ast.Attribute):
        try:
            return getattr(_value(node.value, names, owner, depth + 1), node.attr)
        except AttributeError:
            raise _Unknown from None
    if isinstance(node, ast.BinOp) and type(node.op) in operators:
        left, right = _value(node.left, names, owner, depth + 1), _value(node.right, names, owner, depth + 1)
        if not isinstance(left, int) or not isinstance(right, int):
            raise _Unknown
        return operators[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _value(node.operand, names, owner, depth + 1)
        if not isinstance(value, int):
            raise _Unknown
        return -value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "len"
        and len(node.args) == 1
        and not node.keywords
    ):
        try:
            return len(_value(node.args[0], names, owner, depth + 1))
        except TypeError:
            raise _Unknown from None
    raise _Unknown
