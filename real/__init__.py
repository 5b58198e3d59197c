"""Real checkpoints and scenes: Hugging Face Qwen-VL / Alpamayo-R1 folders, the action expert, scene folders, and the
own-target programs (python -m real.distill, python -m real.aarl_real)."""
