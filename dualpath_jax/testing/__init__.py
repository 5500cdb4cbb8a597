"""Test fault injection: a fault plan file (`testing.fault_plan`) and the block store and KV
channel wrappers that obey it (`testing.faulty`), for the tests and `bench/chaos.py`.

Not for production, and never imported on the serving path: an engine process imports this
wing only when `cluster.fault_file` names a plan (`engines.fault_hook`).
"""
