"""Shared pytest setup: offline Hugging Face hub, deterministic CPU threads.

run: python -m pytest -q tests
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The repo is a flat set of top-level modules; make them importable from tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
