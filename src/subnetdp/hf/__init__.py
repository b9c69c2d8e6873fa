"""Hugging Face interop for trained runs: a run's LLaMA as a ``LlamaForCausalLM`` folder
(``config.json``, HF-named ``model.safetensors``, the run's tokenizer). Nothing here imports
``transformers``: the folder is plain files that transformers, lm-eval or vLLM can read."""

from subnetdp.hf.export import export_hf
from subnetdp.hf.tokenizer import RUN_TOKENIZER, save_run_tokenizer

__all__ = ["RUN_TOKENIZER", "export_hf", "save_run_tokenizer"]
