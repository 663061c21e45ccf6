"""`leantune check`: the engine's parity proof, run on the user's own model, data and plan.

The tests prove on tiny models that streaming, checkpointing and offload change nothing and that
fp8 storage changes little; a user's model, recipe and machine are not those. A check builds the
run as the trainer would (the trainer's own `_build`, never a copy of it) once without any
technique (the reference) and once per technique the plan uses, runs a few optimizer steps from
one seed in each, and compares the losses, every trained parameter's gradient and the trained
weights with the reference: bitwise where the technique is exact, within fp8's measured error
where it is not. One module per job:

- variants.py  the plan the run would use, and one run config per technique (and the whole plan);
- record.py    build one variant, run its steps, record losses, gradients and weights, release it;
- compare.py   one variant against the reference: held, or how it differs and where;
- processes.py the whole plan on N processes (torchrun) against one process at the N-times batch;
- run.py       the order of the runs and the report (lines, exit code): `run_check`.

The package re-exports nothing, so importing one of its modules does not import the others
through it (no import cycle through this file).
"""
