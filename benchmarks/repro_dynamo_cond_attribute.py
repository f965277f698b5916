"""Minimal reproduction: under ``torch.compile``, an attribute stored on a Python object is
lost once a later ``torch.cond`` is traced.

The patched hosts hand the token sizes from block to block through the pooling state
(the host's own loop passes only the hidden states), and the clusterings' iterations use
``torch.cond`` when compiled for the CPU. Three blocks each run a ``torch.cond`` and then
store a value on a shared object; block ``i`` reads what block ``i - 1`` stored. Eager,
and compiled when the value sits in a dict or list entry, every block reads its
predecessor's value. Compiled with the value as an attribute (of a plain object or an
``nn.Module``), the third block reads the first block's, and tracing fails on the shape
mismatch. ``TokenPooling`` therefore keeps the sizes in a dict entry.

Run: ``python benchmarks/repro_dynamo_cond_attribute.py`` (prints, for each way of
storing the value, whether the compiled run matches eager).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Store:
    """One value, kept as an attribute, a dict entry or a list entry."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.value: Tensor | None = None
        self.entries: dict[str, Tensor | None] = {"value": None}
        self.slots: list[Tensor | None] = [None]

    def get(self) -> Tensor | None:
        if self.how == "attribute":
            return self.value
        return self.entries["value"] if self.how == "dict" else self.slots[0]

    def put(self, t: Tensor) -> None:
        if self.how == "attribute":
            self.value = t
        elif self.how == "dict":
            self.entries["value"] = t
        else:
            self.slots[0] = t


class Block(nn.Module):
    def __init__(self, store: Store, first: bool) -> None:
        super().__init__()
        self.store = store
        self.first = first

    def forward(self, x: Tensor) -> Tensor:
        y = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t * 3, (x[:, :-1],))
        previous = None if self.first else self.store.get()
        # Each block drops one column: the predecessor's value is one column wider.
        self.store.put(y if previous is None else y + previous[:, :-1])
        return y


def run(how: str, compiled: bool) -> Tensor | None:
    store = Store(how)
    blocks = nn.Sequential(Block(store, True), Block(store, False), Block(store, False))

    def forward(x: Tensor) -> Tensor | None:
        blocks(x)
        return store.get()

    fn = torch.compile(forward, fullgraph=True, backend="eager") if compiled else forward
    return fn(torch.ones(2, 8))


def main() -> None:
    print(f"torch {torch.__version__}")
    for how in ("attribute", "dict", "list"):
        torch._dynamo.reset()
        eager = run(how, compiled=False)
        try:
            compiled = run(how, compiled=True)
            verdict = "matches eager" if torch.equal(eager, compiled) else "differs from eager"
        except Exception as error:  # the failure this script shows
            verdict = f"fails: {type(error).__name__}"
        print(f"{how:>9}: compiled {verdict}")


if __name__ == "__main__":
    main()
