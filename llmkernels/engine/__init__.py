"""A small engine that runs GGUF models (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3) on llmkernels' kernels.

>>> from llmkernels.engine import LLM, SamplingParams
>>> llm = LLM("model.gguf")
>>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))[0].text
"""
from .config import ModelConfig, ModelConfigError
from .convert import convert_hf_to_gguf, gguf_to_hf_state_dict
from .llm import LLM, CompletionOutput, RequestOutput
from .model import Model, StepInputs
from .sampler import SamplingParams
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["LLM", "CompletionOutput",
           "Model", "ModelConfig", "ModelConfigError", "RequestOutput", "SamplingParams", "StepInputs",
           "Tokenizer", "TokenizerError", "convert_hf_to_gguf", "gguf_to_hf_state_dict"]
