"""Attention: one mask predicate (mask.py) and backends behind one signature (base.py)."""
