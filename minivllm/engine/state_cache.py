"""The recurrent state's bookkeeping for hybrid models: state slots and state snapshots.

A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) carries, per
running sequence, a fixed-size state (each linear-attention layer's conv and recurrent
state) that K/V blocks cannot give back: it is the fold of every token so far. The
executor holds two pools of such states; this module decides who uses which entry:

- **slots**: one per running sequence, the state after its computed tokens. A slot
  taken by a sequence starts from the zero state (``STATE_RESET``) or from a snapshot
  (a prefix-cache hit); a preempted or finished sequence gives its slot back.
- **snapshots**: copies of a sequence's state at a full-block boundary (``boundaries``:
  every ``snapshot_interval``-th, a prompt's last full one, and where a prompt's cached
  prefix ends short of a snapshot), tied to the chained hash of the block that ends there
  (``engine/block_manager.py``), so a later request whose prefix hits that block resumes
  from the snapshot instead of recomputing its whole prefix. A snapshot is reserved when a
  step is planned (the executor writes it during the step), bound to its hash when the
  step completes, and dropped when the hash is evicted with its block, or (the oldest
  first) when a new boundary needs one and all are taken, if no running sequence holds
  its block.

No tensor lives here; slot and snapshot ids index the executor's pools.
"""

from __future__ import annotations

from typing import Callable

from minivllm.engine.sequence import Sequence

# ``StepPlan.state_init`` values besides a snapshot id (>= 0).
STATE_CONTINUE = -1   # the slot holds the state after the row's first fed position
STATE_RESET = -2      # the row starts from the zero state (its first chunk, nothing cached)


class StateCache:
    """Slots and snapshots of a hybrid model's recurrent state.

    Args:
        num_slots: states the executor holds for running sequences (>= 1).
        num_snapshots: states it holds for prefix-cache snapshots (0: hits on a hybrid
            model never resume, every prompt is computed whole).
        snapshot_interval: a snapshot is taken at every ``snapshot_interval``-th full block
            boundary and at the last full block of a prompt (``boundaries``).
    """

    def __init__(self, num_slots: int, num_snapshots: int, snapshot_interval: int) -> None:
        if num_slots < 1 or num_snapshots < 0 or snapshot_interval < 1:
            raise ValueError(f"state pool: num_slots >= 1, num_snapshots >= 0 and snapshot_interval >= 1, "
                             f"got {num_slots}, {num_snapshots}, {snapshot_interval}")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.snapshot_interval = snapshot_interval
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.free_snapshots: list[int] = list(range(num_snapshots - 1, -1, -1))
        self.snapshot_of: dict[int, int] = {}   # block hash -> snapshot id holding the state at its end

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    # ---- slots --------------------------------------------------------------

    def take_slot(self, seq: Sequence, restore: int | None) -> None:
        """Give ``seq`` a slot, to start from snapshot ``restore`` or (None) from the zero state."""
        assert seq.state_slot is None and self.free_slots, "caller checks num_free_slots"
        seq.state_slot = self.free_slots.pop()
        seq.state_init = STATE_RESET if restore is None else restore

    def release(self, seq: Sequence) -> None:
        """Take back ``seq``'s slot and the snapshots it reserved that no hash took."""
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None
        seq.state_init = STATE_CONTINUE
        self.free_snapshots.extend(seq.pending_snapshots.values())
        seq.pending_snapshots.clear()

    # ---- snapshots ----------------------------------------------------------

    def boundaries(self, seq: Sequence, start: int, end: int, block_size: int) -> list[int]:
        """Full-block counts j whose boundary j * block_size lies in (start, end] and that the
        rule snapshots: every ``snapshot_interval``-th, the prompt's last full block, and the
        end of the K/V its prefix lookup found cached (``Sequence.cached_prefix_blocks``) where
        no snapshot reached it: the point where its prompt branches off an earlier one's (a
        shared system prompt's end), so the next prompt on that branch resumes there."""
        keep = {seq.num_prompt_tokens // block_size, seq.cached_prefix_blocks}
        first, last = start // block_size + 1, end // block_size
        return [j for j in range(first, last + 1) if j % self.snapshot_interval == 0 or j in keep]

    def reserve(self, seq: Sequence, blocks: int, evictable: Callable[[int], bool]) -> int | None:
        """A snapshot id for the state after ``seq``'s first ``blocks`` full blocks, or None (the
        hash of that block has one already, or every snapshot is reserved or tied to a block
        in use). With none free, the oldest snapshot whose hash ``evictable`` says no sequence
        holds is given up for it: else a full pool would stop every later snapshot, and hits
        on new prefixes would never resume."""
        if blocks in seq.pending_snapshots:
            return None
        if len(seq.block_hashes) >= blocks and seq.block_hashes[blocks - 1] in self.snapshot_of:
            return None
        if not self.free_snapshots:
            old = next((h for h in self.snapshot_of if evictable(h)), None)
            if old is None:
                return None
            self.drop(old)
        snap = self.free_snapshots.pop()
        seq.pending_snapshots[blocks] = snap
        return snap

    def bind(self, seq: Sequence, hashes: list[int], num_full: int) -> None:
        """After a step completed ``seq``'s first ``num_full`` full blocks: tie each snapshot it
        reserved at one of them to that block's hash (``hashes``), or give it back when the
        hash has one already."""
        for blocks in [b for b in seq.pending_snapshots if b <= num_full]:
            snap = seq.pending_snapshots.pop(blocks)
            h = hashes[blocks - 1]
            if h in self.snapshot_of:
                self.free_snapshots.append(snap)
            else:
                self.snapshot_of[h] = snap

    def drop(self, block_hash: int) -> None:
        """The hash left the prefix cache (its block was evicted): so does its snapshot."""
        snap = self.snapshot_of.pop(block_hash, None)
        if snap is not None:
            self.free_snapshots.append(snap)

    def deepest(self, hashes: list[int]) -> int:
        """How many leading blocks of a hit (their ``hashes``) a sequence may resume after:
        the deepest one whose end has a snapshot (0: none)."""
        for j in range(len(hashes), 0, -1):
            if hashes[j - 1] in self.snapshot_of:
                return j
        return 0

    # ---- invariants ---------------------------------------------------------

    def check(self, live: list[Sequence], cached_hashes: set[int]) -> list[str]:
        """What is wrong with the pools given the live sequences and the hashes in the
        prefix cache (empty when nothing)."""
        errors = [f"{s}: live without a state slot" for s in live if s.state_slot is None][:1]
        held = [s.state_slot for s in live if s.state_slot is not None]
        if len(set(held)) != len(held):
            errors.append(f"two live sequences hold one state slot: {sorted(held)}")
        if sorted(held + self.free_slots) != list(range(self.num_slots)):
            errors.append(f"state slots held {sorted(held)} and free {sorted(self.free_slots)} "
                          f"are not the pool of {self.num_slots}")
        pending = [s for seq in live for s in seq.pending_snapshots.values()]
        snaps = pending + list(self.snapshot_of.values()) + self.free_snapshots
        if sorted(snaps) != list(range(self.num_snapshots)):
            errors.append(f"snapshots reserved {sorted(pending)}, bound {sorted(self.snapshot_of.values())} and "
                          f"free {sorted(self.free_snapshots)} are not the pool of {self.num_snapshots}")
        stale = [h for h in self.snapshot_of if h not in cached_hashes]
        if stale:
            errors.append(f"snapshots tied to hashes no block carries: {stale[:4]}")
        return errors
