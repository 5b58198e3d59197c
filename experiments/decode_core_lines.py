"""Lines of the decode core at a commit: speculate.py and tree.py whole, ops/compiled.py's CompiledSteps, and model.py's
attention, cache and step (Attention, feed, causal_mask, grouped_mask, KVCache, VLA.step, VLA.new_cache), counted
from the AST. Paper: none; issue #34 asked the core to end no longer than it was.

run: python experiments/decode_core_lines.py [REV ...]      (no REV: the working tree)
"""
import ast
import subprocess
import sys

PARTS = {"Attention", "KVCache", "CompiledSteps", "feed", "causal_mask", "grouped_mask"}


def source(path, rev=None):
    """The file at rev ("" when it does not exist there), or in the working tree."""
    if rev is None:
        try:
            return open(path).read()
        except FileNotFoundError:
            return ""
    out = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else ""


def core_lines(rev=None):
    counts = {f: len(source(f, rev).splitlines()) for f in ("speculate.py", "tree.py")}
    model = 0  # and CompiledSteps, in ops/compiled.py since it left model.py
    for node in [n for f in ("model.py", "ops/compiled.py") for n in ast.parse(source(f, rev)).body]:
        if getattr(node, "name", None) in PARTS:
            model += node.end_lineno - node.lineno + 1 + len(getattr(node, "decorator_list", []))
        if getattr(node, "name", None) == "VLA":
            model += sum(f.end_lineno - f.lineno + 1 for f in node.body if getattr(f, "name", None) in ("step",
                                                                                                     "new_cache"))
    return dict(counts, model_core=model, total=sum(counts.values()) + model)


if __name__ == "__main__":
    for rev in sys.argv[1:] or [None]:
        print(rev or "working tree", core_lines(rev))
