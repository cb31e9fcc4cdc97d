"""The broker's core: the hub, sans-IO. Modules by job: ``flow`` (the ``Hub``: its ways in, and a step's
path to batches and replies), ``joining`` (games take seats, trainers attach, either leaves), ``seating``
(slots and env layout), ``holding`` (the one place where time and deadlines live), ``sessions`` and
``states`` (the records, and the one transition table of their states), ``status`` (notices, snapshot),
``accumulate`` / ``batching`` (rows between ticks and batches), ``effects`` (what the hub asks its caller
to do: the server carries them out, ``broker.server.entry.apply``).

Theory of operation
-------------------
* ``expected_games`` game slots. A game that joins takes the lowest free slot; a slot keeps the group
  layout (policies and agent counts) of the first game that used it, so a replacement game must match.
* A policy's VecEnv has one env per agent of that policy over all slots, in slot order. The layout is
  fixed once every slot has been filled once; trainers then receive ``PolicyInfo``.
* A game sends one ``step`` and waits for ``actions``. Each group's tick is merged into that policy's
  accumulator for the game's slot (``SlotAccumulator``). A batch goes to the policy's trainer when it
  has asked for one and every slot has at least one tick since the previous batch; rows are concatenated
  (one copy per key).
* The game's reply is sent as soon as every group either has fresh actions from its trainer or may be
  held. Hold mode (default): a group is held when its policy has no trainer, or when its trainer has not
  answered within the policy's deadline; held agents keep their last action (or get zeros, "noop").
  Barrier mode: the game waits for the actions (up to a deadline if one is set, then holds).
  Held ticks keep accumulating: the trainer's next transition carries the summed reward and ``frames``.
  (Deadlines, pacing and stalls: broker/core/holding.py.)
* An action computed from an observation whose episode has ended meanwhile is not applied to the next
  episode: those agents keep their previous action and the row's info says ``action_applied: false``.
* A lost game: its undelivered rows are dropped; when a game takes the slot again, its first step
  reports every agent of the slot as truncated, with the last observation the trainer saw as the
  final observation, so SB3's episode bookkeeping stays right.
* A lost trainer: the batch it did not answer is sent again to the next trainer of that policy.
* A sampler (``claims.py``) claims whole games instead of one policy: per policy of those games it gets its
  own ``PolicyState`` over the claimed slots, which the games' steps go to (``GameSession.policies``);
  claimed slots leave the per-policy layouts for good.
Memory is bounded by one accumulator per slot and policy (infos replaced, never merged, across held
ticks), and one open batch per policy. A batch its trainer's codec cannot carry comes back through
``batch_undeliverable`` and goes again without the offending infos.
"""
