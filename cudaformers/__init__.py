"""cudaformers: load Hugging-Face-format LLM checkpoints and run, serve and train them on NVIDIA GPUs.

The public names are imported lazily so that `import cudaformers` stays cheap and features with
optional dependencies (the server stack, gguf) load only when used.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "AutoConfig": "cudaformers.config",
    "PretrainedConfig": "cudaformers.config",
    "AutoTokenizer": "cudaformers.tokenizer",
    "Tokenizer": "cudaformers.tokenizer",
    "DetokenizeStream": "cudaformers.tokenizer",
    "AutoModelForCausalLM": "cudaformers.models.auto",
    "GenerationConfig": "cudaformers.generation.config",
    "TextStreamer": "cudaformers.generation.streamer",
    "TextIteratorStreamer": "cudaformers.generation.streamer",
    "pipeline": "cudaformers.generation.pipeline",
    "LLM": "cudaformers.engine.llm",
    "SamplingParams": "cudaformers.engine.sampling_params",
    "RequestOutput": "cudaformers.engine.sequence",
    "KernelConfig": "cudaformers.kernels.hub",
    "BitsAndBytesConfig": "cudaformers.quant.config",
    "Int8Config": "cudaformers.quant.config",
    "Int4Config": "cudaformers.quant.config",
    "FP8Config": "cudaformers.quant.config",
    "GPTQConfig": "cudaformers.quant.config",
    "AwqConfig": "cudaformers.quant.config",
    "LoraConfig": "cudaformers.peft.lora",
    "get_peft_model": "cudaformers.peft.lora",
    "PeftModel": "cudaformers.peft.lora",
    "TrainingArguments": "cudaformers.train.arguments",
    "Trainer": "cudaformers.train.trainer",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cudaformers' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
