"""Where a JAX applier writes: an engine's weight pytree, named leaf by leaf.

A leaf's name is its key path joined by dots (`model.layers.0.self_attn.q_proj.weight`; a
Flax NNX variable's trailing `.value` dropped). Three kinds of target:

- `WeightsHolder`: the applier owns the reference. Readers take `get()`, one consistent
  tree; a version is swapped in by replacing the reference under a lock, so a reader
  never sees two versions mixed.
- `InPlaceTree`: the engine owns a live tree (an `nnx.State`, nested dicts and lists);
  leaves are set where they are (`d[k] = new`, `variable.value = new`). The engine must
  not run between the first and the last (the applier's pause; the engine's refresh
  re-points whatever it derived from the old leaves).
- `CallbackTarget`: the caller's own `leaves()` and `replace(new)`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from weightsync.errors import InvalidArgument


class Target(Protocol):
    """What an applier needs of an engine's weights."""

    def leaves(self) -> dict[str, Any]:
        """Every leaf by name (jax.Arrays; anything else is left alone)."""
        ...

    def replace(self, new: Mapping[str, Any]) -> None:
        """Puts the named leaves in, in one step as the engine's readers see it."""
        ...


def _key_name(k: Any) -> str:
    if isinstance(k, DictKey):
        return str(k.key)
    if isinstance(k, SequenceKey):
        return str(k.idx)
    if isinstance(k, GetAttrKey):
        return k.name
    if isinstance(k, FlattenedIndexKey):
        return str(k.key)
    return str(k)


def leaf_name(path: tuple[Any, ...]) -> str:
    """A key path as a dotted name; NNX's trailing `value` dropped."""
    names = [_key_name(k) for k in path]
    if len(names) > 1 and names[-1] == "value":
        names = names[:-1]
    return ".".join(names)


def named_leaves(tree: Any) -> tuple[dict[str, tuple[tuple[Any, ...], Any]], Any]:
    """name -> (key path, leaf) of every leaf, and the tree's structure. Two leaves whose
    names collide (keys 1 and '1') are refused: a name must say which leaf it is."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out: dict[str, tuple[tuple[Any, ...], Any]] = {}
    for path, leaf in flat:
        name = leaf_name(path)
        if name in out:
            raise InvalidArgument(f"two leaves of the engine's tree are both named {name!r}", field="target")
        out[name] = (path, leaf)
    return out, treedef


class WeightsHolder:
    """Holds an engine's weight pytree; `replace` swaps a new tree in under a lock.

    Readers call `get()` and use what it returned for a whole step: they see one version
    or the next, never a mix, and the old leaves live on until the last reader drops them.
    """

    def __init__(self, tree: Any) -> None:
        self._lock = threading.Lock()
        self._tree = tree
        self.version = 0

    def get(self) -> Any:
        with self._lock:
            return self._tree

    def leaves(self) -> dict[str, Any]:
        named, _ = named_leaves(self.get())
        return {name: leaf for name, (_, leaf) in named.items()}

    def replace(self, new: Mapping[str, Any]) -> None:
        with self._lock:
            named, treedef = named_leaves(self._tree)
            missing = set(new) - set(named)
            if missing:
                raise InvalidArgument(f"the tree has no leaf {sorted(missing)[0]!r}", field="target")
            self._tree = jax.tree_util.tree_unflatten(treedef, [new.get(n, leaf) for n, (_, leaf) in named.items()])


class InPlaceTree:
    """An engine's live tree, written where its leaves are (dict items, list items,
    attributes, NNX variables' `.value`)."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def leaves(self) -> dict[str, Any]:
        named, _ = named_leaves(self.tree)
        return {name: leaf for name, (_, leaf) in named.items()}

    def replace(self, new: Mapping[str, Any]) -> None:
        named, _ = named_leaves(self.tree)
        places = []
        for name, leaf in new.items():  # every place found and checked before the first write
            if name not in named:
                raise InvalidArgument(f"the tree has no leaf {name!r}", field="target")
            path = named[name][0]
            parent = self._parent(path)
            _check_settable(parent, path[-1])
            places.append((parent, path[-1], leaf))
        for parent, key, leaf in places:
            _set(parent, key, leaf)

    def _parent(self, path: tuple[Any, ...]) -> Any:
        node = self.tree
        for k in path[:-1]:
            node = _get(node, k)
        return node


def _get(node: Any, k: Any) -> Any:
    if isinstance(k, DictKey):
        return node[k.key]
    if isinstance(k, SequenceKey):
        return node[k.idx]
    if isinstance(k, GetAttrKey):
        return getattr(node, k.name)
    raise InvalidArgument(
        f"cannot write through a {type(node).__name__} (key {k}); use a WeightsHolder or a CallbackTarget",
        field="target",
    )


def _check_settable(node: Any, k: Any) -> None:
    if isinstance(k, GetAttrKey):
        params = getattr(type(node), "__dataclass_params__", None)
        ok = not (params is not None and params.frozen)
    else:
        ok = isinstance(k, (DictKey, SequenceKey)) and hasattr(node, "__setitem__")
    if not ok:
        raise InvalidArgument(
            f"cannot set a leaf of a {type(node).__name__} in place (key {k}); use a WeightsHolder or a CallbackTarget",
            field="target",
        )


def _set(node: Any, k: Any, value: Any) -> None:
    if isinstance(k, DictKey):
        node[k.key] = value
    elif isinstance(k, SequenceKey):
        node[k.idx] = value
    else:
        setattr(node, k.name, value)


class CallbackTarget:
    """The caller's own leaves and swap."""

    def __init__(self, leaves: Callable[[], Mapping[str, Any]], replace: Callable[[Mapping[str, Any]], None]) -> None:
        self._leaves, self._replace = leaves, replace

    def leaves(self) -> dict[str, Any]:
        return dict(self._leaves())

    def replace(self, new: Mapping[str, Any]) -> None:
        self._replace(new)


def as_target(obj: Any) -> Target:
    """A target as is; any other pytree is written in place."""
    if all(hasattr(obj, m) for m in ("leaves", "replace")) and not isinstance(obj, Mapping):
        return obj  # type: ignore[no-any-return]
    return InPlaceTree(obj)
