"""R3 through verl's batch type, end to end on the embedded engine (docs/frameworks/verl.md).

rollouts (embedded MoE engine over HTTP) -> rollout table -> verl ``DataProto`` (the layout
verl's agent loop hands the trainer) -> back to a table -> Parquet -> routing stats ->
``MegatronCollator`` -> replay into real megatron-core ``TopKRouters`` on this CPU.

Needs the ``all`` extra plus verl (``pip install --no-deps verl==0.9.1`` and
``-r ci/verl-requirements.txt``). The replay stage runs real routers on this CPU
with `r3arrow.testing.megatron` (the harness for tests, demos and examples, not for training);
without megatron-core it stops after collation. Prints one line per stage and
exits 1 if a check fails::

    python examples/verl_loop.py --groups 3 --samples 2 --out /tmp/verl-loop
"""

from __future__ import annotations

import sys
import time

import numpy as np

# `python examples/verl_loop.py` puts examples/ on sys.path, so the shared stages import as _common
from _common import (
    collate,
    done,
    parquet_stage,
    parse_args,
    replay,
    rollout_stage,
    say,
    stats_stage,
    verdict,
)

PAD = 0  # the embedded engine's vocabulary has no pad token; verl pads with the tokenizer's


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, "verl-loop", argv)

    from r3arrow.adapters.verl import CAPTURED_KEY, from_dataproto, to_dataproto
    from r3arrow.table import captured_lengths, sequence_lengths
    from r3arrow.testing import assert_rollouts_equal

    t0 = time.perf_counter()
    ok = True
    table, spec = rollout_stage(args, "1/7")

    data = to_dataproto(table, pad_token_id=PAD)
    b = data.batch
    routed = b["routed_experts"]
    say(
        f"[2/7] verl DataProto: prompts {tuple(b['prompts'].shape)} left-padded, responses "
        f"{tuple(b['responses'].shape)} right-padded, routed_experts {tuple(routed.shape)} "
        f"{str(routed.dtype).removeprefix('torch.')}, uid + {CAPTURED_KEY} in non_tensor_batch"
    )

    back = from_dataproto(data, spec, pad_token_id=PAD)
    try:
        assert_rollouts_equal(back, table)
        exact = True
    except AssertionError as exc:
        say(f"  mismatch: {exc}")
        exact = False
    ok = ok and exact
    # verl keeps no captured count: its trainer replays every attended row but the last
    rule = bool(np.array_equal(captured_lengths(table), sequence_lengths(table) - 1))
    say(
        f"[3/7] back to a rollout table: {back.num_rows} rows, round trip exact: {exact}; "
        f"verl's rule (all attended rows but the last) = the engine's rows: {rule}"
    )

    disk, same = parquet_stage(back, args.out, "4/7")
    ok = ok and same

    stats_stage(disk, "5/7")

    parts, batches = collate(spec, disk)
    first = batches[0]
    targets = first.replay_targets()
    assert first.routes is not None  # collated with a spec: R3 is on
    say(
        f"[6/7] megatron collation: {len(batches)} packed microbatch(es), first routes "
        f"{tuple(first.routes.shape)}, {len(targets)} replay targets"
    )

    checked, differ, skipped = replay(spec, parts, batches)
    if skipped is not None:
        say(f"[7/7] replay: skipped ({skipped})")
    else:
        ok = ok and differ == 0
        say(
            f"[7/7] replay into {len(first.layers)} real megatron-core TopKRouters: "
            f"{checked} tokens, routing {verdict(differ)} to the engine's"
        )
    return done(t0, ok)


if __name__ == "__main__":
    sys.exit(main())
