"""Data for Tandem: loading rows from files, SFT packing, synthetic verifiable tasks.

Modules are imported directly (``from tandem.rl.data.tasks import make_task_rows``);
this package imports nothing so each stays cheap to load.
"""
