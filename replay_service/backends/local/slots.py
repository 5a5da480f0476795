"""Where a local table's items live: their slots, keys, insertion order and uniform draws.

A table of `capacity` items keeps each item's metadata (first step, priority, samples) in
arrays indexed by slot, `0 <= slot < capacity`. `Slots` is the one interface to which slots are
held, in which order they were inserted and what their keys are; two implementations, chosen by
how the table removes items (`slots_for`):

- `RingSlots`: items leave oldest first only, by the FIFO remover, `reset`, or the "fifo"
  sampler's `max_times_sampled` (which removes the oldest). The held items are then the
  insertion numbers `[oldest, next)`, item `n` in slot `n % capacity`: order, keys and uniform
  draws follow from two counters, with no array per item.
- `ListSlots`: items may also leave out of order ("uniform" or "prioritized" sampling with
  `max_times_sampled`): a doubly linked list in insertion order, the occupied slots densely
  for uniform draws (`dense[:size]`, `where[slot]` its position) and each slot's key, 40 bytes
  per slot.

An item's key is `(n * capacity + slot) * stride + offset + 1`, `n` the number of items
inserted before it, `stride` the number of tables of the buffer and `offset` the table's index
among them (0 and 1 for a table alone): never 0, unique for the table's life and across the
buffer's tables (a key of one table is never one of another's, so an update with it is ignored
there, as Reverb ignores unknown keys), growing with the insertion order, and it names the
item's slot without a map.
"""

from __future__ import annotations

import abc

import numpy as np

from replay_service.config.options import TableConfig


def item_keys(
    numbers: np.ndarray, slots: np.ndarray, capacity: int, stride: int = 1, offset: int = 0
) -> np.ndarray:
    """The keys of the items inserted `numbers`-th into `slots` of a table of `capacity`
    items, uint64 (see the module docstring).

    Args:
      numbers: Insertion numbers.
      slots: Their slots.
      capacity: Items the table holds at most.
      stride: Tables of the buffer.
      offset: The table's index among them, `0 <= offset < stride`.

    Returns:
      The keys, uint64.
    """
    base = numbers.astype(np.uint64) * np.uint64(capacity) + slots.astype(np.uint64)
    return base * np.uint64(stride) + np.uint64(offset + 1)


class Slots(abc.ABC):
    """The held slots of a table of `capacity` items (see the module docstring).

    Args:
      capacity: Items the table holds at most.
      stride: Tables of the buffer (keys of its tables never coincide).
      offset: The table's index among them, `0 <= offset < stride`.
    """

    def __init__(self, capacity: int, stride: int = 1, offset: int = 0) -> None:
        if not 0 <= offset < stride:
            raise ValueError(f"a table's key offset must be in [0, {stride}), got {offset}")
        self.capacity = capacity
        self.stride = stride
        self.offset = offset
        self.size = 0
        self.next = 0  # the insertion number of the next item

    def keys_for(self, numbers: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The keys of the items inserted `numbers`-th into `slots`, uint64."""
        return item_keys(numbers, slots, self.capacity, self.stride, self.offset)

    def key_of(self, number: int, slot: int) -> int:
        """`keys_for` of one item, as a Python int."""
        return (number * self.capacity + slot) * self.stride + self.offset + 1

    def split(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(insertion numbers, slots, ours)` of `keys` (uint64, each >= 1): numbers and slots
        int64, `ours` False for a key of another table of the buffer."""
        shifted = keys - np.uint64(1)
        stride = np.uint64(self.stride)
        ours = shifted % stride == np.uint64(self.offset)
        base = shifted // stride
        capacity = np.uint64(self.capacity)
        return (base // capacity).astype(np.int64), (base % capacity).astype(np.int64), ours

    def split_one(self, key: int) -> tuple[int, int] | None:
        """`(insertion number, slot)` of one key (any int); None where it cannot be one of
        this table's."""
        if key < 1 or key >= 1 << 64:
            return None
        base, tag = divmod(key - 1, self.stride)
        if tag != self.offset:
            return None
        return divmod(base, self.capacity)

    @abc.abstractmethod
    def allocate(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Takes slots for the next `count` items, in insertion order (the caller made room:
        `size + count <= capacity`).

        Returns:
          `(slots int64, keys uint64)`.
        """

    @abc.abstractmethod
    def allocate_one(self) -> tuple[int, int]:
        """`allocate(1)` as Python ints `(slot, key)`, without arrays (a collector's insert)."""

    @abc.abstractmethod
    def remove(self, slots: np.ndarray) -> None:
        """Frees the held `slots` (distinct).

        Raises:
          AssertionError: If a `RingSlots` is asked to free others than its oldest.
        """

    def remove_oldest(self, count: int) -> np.ndarray:
        """Frees the `count` (<= size) oldest slots and returns them."""
        slots = self.oldest(count)
        self.remove(slots)
        return slots

    @abc.abstractmethod
    def remove_oldest_one(self) -> int:
        """`remove_oldest(1)` as a Python int, without arrays (size > 0)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Frees every slot (keys are not reused)."""

    @abc.abstractmethod
    def oldest(self, count: int) -> np.ndarray:
        """The `count` (<= size) oldest held slots, oldest first."""

    @abc.abstractmethod
    def newest(self, count: int) -> np.ndarray:
        """The `count` newest held slots (all of them if fewer), in no particular order."""

    @abc.abstractmethod
    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` held slots drawn uniformly with replacement (size > 0)."""

    @abc.abstractmethod
    def keys(self, slots: np.ndarray) -> np.ndarray:
        """The keys of the items in the held `slots`, uint64."""

    @abc.abstractmethod
    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(slots, held)` of `keys` (uint64, each >= 1): held is False for keys of items no
        longer (or never) in the table."""

    def ordered(self) -> np.ndarray:
        """Every held slot, oldest first."""
        return self.oldest(self.size)

    @abc.abstractmethod
    def holds(self, key: int) -> bool:
        """Whether the item of `key` (any int) is held."""


class RingSlots(Slots):
    """Items removed oldest first only: item `n` in slot `n % capacity`, the held items
    `[oldest, next)`."""

    def __init__(self, capacity: int, stride: int = 1, offset: int = 0) -> None:
        super().__init__(capacity, stride, offset)
        self.first = 0  # the insertion number of the oldest held item

    def allocate(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        numbers = np.arange(self.next, self.next + count, dtype=np.int64)
        slots = numbers % self.capacity
        self.next += count
        self.size += count
        return slots, self.keys_for(numbers, slots)

    def allocate_one(self) -> tuple[int, int]:
        number = self.next
        slot = number % self.capacity
        self.next += 1
        self.size += 1
        return slot, self.key_of(number, slot)

    def holds(self, key: int) -> bool:
        # `split_one`, inline: a collector asks on every insert.
        if key < 1 or key >= 1 << 64:
            return False
        base, tag = divmod(key - 1, self.stride)
        if tag != self.offset:
            return False
        number, slot = divmod(base, self.capacity)
        return self.first <= number < self.next and slot == number % self.capacity

    def remove(self, slots: np.ndarray) -> None:
        count = len(slots)
        if not count:
            return
        expected = self.oldest(count)
        if count > self.size or not np.array_equal(np.sort(slots), np.sort(expected)):
            raise AssertionError(
                f"a ring of slots frees its oldest items only: asked {slots[:8]}, oldest "
                f"{expected[:8]}"
            )
        self.first += count
        self.size -= count

    def remove_oldest(self, count: int) -> np.ndarray:
        slots = self.oldest(count)
        self.first += count
        self.size -= count
        return slots

    def remove_oldest_one(self) -> int:
        slot = self.first % self.capacity
        self.first += 1
        self.size -= 1
        return slot

    def clear(self) -> None:
        self.first = self.next
        self.size = 0

    def oldest(self, count: int) -> np.ndarray:
        return (self.first + np.arange(count, dtype=np.int64)) % self.capacity

    def newest(self, count: int) -> np.ndarray:
        count = min(count, self.size)
        return (self.next - count + np.arange(count, dtype=np.int64)) % self.capacity

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        numbers = rng.integers(0, self.size, count) + self.first
        return numbers % self.capacity

    def keys(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        numbers = self.first + (slots - self.first) % self.capacity
        return self.keys_for(numbers, slots)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        numbers, slots, ours = self.split(keys)
        # Item `n` is in slot `n % capacity`: a key with another slot was never handed out.
        held = (numbers >= self.first) & (numbers < self.next) & (slots == numbers % self.capacity)
        return slots, held & ours


class ListSlots(Slots):
    """Items that may be removed in any order: a linked list in insertion order, the occupied
    slots densely, each slot's key."""

    def __init__(self, capacity: int, stride: int = 1, offset: int = 0) -> None:
        super().__init__(capacity, stride, offset)
        self._key = np.zeros(capacity, dtype=np.uint64)
        # Neighbours in insertion order (-1: none), the occupied slots densely.
        self._newer = np.full(capacity, -1, dtype=np.int64)
        self._older = np.full(capacity, -1, dtype=np.int64)
        self._oldest = -1
        self._newest = -1
        self._dense = np.arange(capacity, dtype=np.int64)
        self._where = np.arange(capacity, dtype=np.int64)

    def allocate_one(self) -> tuple[int, int]:
        slot = int(self._dense[self.size])
        key = self.key_of(self.next, slot)
        self._key[slot] = key
        self.next += 1
        self.size += 1
        newest = self._newest
        self._older[slot] = newest
        self._newer[slot] = -1
        if newest >= 0:
            self._newer[newest] = slot
        else:
            self._oldest = slot
        self._newest = slot
        return slot, key

    def holds(self, key: int) -> bool:
        split = self.split_one(key)
        if split is None:
            return False
        slot = split[1]
        return int(self._key[slot]) == key and int(self._where[slot]) < self.size

    def allocate(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        slots = self._dense[self.size : self.size + count].copy()
        numbers = np.arange(self.next, self.next + count, dtype=np.int64)
        keys = self.keys_for(numbers, slots)
        self._key[slots] = keys
        self.next += count
        self.size += count
        first = int(slots[0])
        newest = self._newest
        self._older[first] = newest
        if newest >= 0:
            self._newer[newest] = first
        else:
            self._oldest = first
        self._older[slots[1:]] = slots[:-1]
        self._newer[slots[:-1]] = slots[1:]
        self._newest = int(slots[-1])
        self._newer[self._newest] = -1
        return slots, keys

    def remove_oldest_one(self) -> int:
        slot = self._oldest
        self.remove([slot])
        return slot

    def remove(self, slots: np.ndarray | list[int]) -> None:
        dense, where, newer, older = self._dense, self._where, self._newer, self._older
        for slot in np.asarray(slots, dtype=np.int64).tolist():
            before, after = int(older[slot]), int(newer[slot])
            if before >= 0:
                newer[before] = after
            else:
                self._oldest = after
            if after >= 0:
                older[after] = before
            else:
                self._newest = before
            position = int(where[slot])
            last = self.size - 1
            moved = int(dense[last])
            dense[position], dense[last] = moved, slot
            where[moved], where[slot] = position, last
            self.size -= 1

    def clear(self) -> None:
        self.size = 0
        self._dense[:] = np.arange(self.capacity, dtype=np.int64)
        self._where[:] = np.arange(self.capacity, dtype=np.int64)
        self._newer[:] = -1
        self._older[:] = -1
        self._oldest = self._newest = -1

    def oldest(self, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        slot = self._oldest
        for index in range(count):
            out[index] = slot
            slot = int(self._newer[slot])
        return out

    def ordered(self) -> np.ndarray:
        held = self._dense[: self.size]
        return held[np.argsort(self._key[held], kind="stable")]  # keys grow with the order

    def newest(self, count: int) -> np.ndarray:
        held = self._dense[: self.size]
        if count >= self.size:
            return held.copy()
        cut = self.size - count
        return held[np.argpartition(self._key[held], cut)[cut:]]

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return self._dense.take(rng.integers(0, self.size, count))

    def keys(self, slots: np.ndarray) -> np.ndarray:
        return self._key.take(slots)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _, slots, ours = self.split(keys)
        return slots, (self._key[slots] == keys) & (self._where[slots] < self.size) & ours


def slots_for(config: TableConfig, stride: int = 1, offset: int = 0) -> Slots:
    """`RingSlots` where the table removes its oldest items only, else `ListSlots`.

    Args:
      config: The table's configuration (capacity and sampling).
      stride: Tables of the buffer.
      offset: The table's index among them.
    """
    sampling = config.sampling
    if sampling.max_times_sampled and sampling.sampler != "fifo":
        return ListSlots(config.capacity, stride, offset)
    return RingSlots(config.capacity, stride, offset)
