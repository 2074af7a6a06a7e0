"""The model (chapter 01): a Llama-family decoder over the paged KV cache, and its loader."""

from minicb.model.llama import SUPPORTED_ARCHITECTURES, LlamaModel, ModelConfig
from minicb.model.loader import BUNDLED_MODELS, MODEL_ALIASES, ModelInfo, is_bundled, load_model

__all__ = ["BUNDLED_MODELS", "MODEL_ALIASES", "SUPPORTED_ARCHITECTURES", "LlamaModel",
           "ModelConfig", "ModelInfo", "is_bundled", "load_model"]
