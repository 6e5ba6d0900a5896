"""lethe: the sparse-first inference engine in Python (ctypes over include/lethe.h).

    import lethe
    llm = lethe.LLM("models/SmolLM2-135M-Instruct.Q4_1.gguf", sparse_method="streamingllm")
    for out in llm.generate(["Once upon a time"], lethe.SamplingParams(temperature=0, max_tokens=16)):
        print(out.outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])
    for piece in llm.stream("Once upon a time"):
        print(piece.text, end="")
    llm.stats()
"""
from ._ffi import library_path
from .llm import (LLM, CompletionOutput, LetheError, RequestOutput, SamplingParams, StreamOutput,
                  StructuredOutputsParams)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "StreamOutput",
           "LetheError", "library_path", "__version__"]
