"""The architectures CI verifies exact, by architecture key (self_check.architecture_key): the
registry's configs of every admitted family, each through the self-check in CI's tests
(tests/exactness/test_admission.py fails when it differs). A model
whose key is here skips the self-check; any other is checked once per process before its first step.

Generated: `python -m tests.exactness.test_admission`.
"""

# architecture key -> (class name, the worst relative error of its self-check)
VERIFIED: dict[str, tuple[str, float]] = {
    "DeepseekV3ForCausalLM-1b0a414ee998": ("DeepseekV3ForCausalLM", 1.4e-16),
    "Gemma3ForCausalLM-23e97ea52435": ("Gemma3ForCausalLM", 1.4e-16),
    "GptOssForCausalLM-61e0ae21568d": ("GptOssForCausalLM", 2.8e-16),
    "Llama4ForCausalLM-907e2b2d3072": ("Llama4ForCausalLM", 1.4e-16),
    "LlamaForCausalLM-3654b32f78be": ("LlamaForCausalLM", 1.4e-16),
    "LlamaForCausalLM-8d44cd2a0104": ("LlamaForCausalLM", 2.9e-16),
    "MistralForCausalLM-a5b29a2877ca": ("MistralForCausalLM", 0.0),
    "MixtralForCausalLM-9add22031a9e": ("MixtralForCausalLM", 1.4e-16),
    "MixtralForCausalLM-9b00dba76765": ("MixtralForCausalLM", 1.4e-16),
    "Olmo3ForCausalLM-664b9aff1da8": ("Olmo3ForCausalLM", 1e-15),
    "Phi3ForCausalLM-edd18248b894": ("Phi3ForCausalLM", 1.4e-16),
    "Qwen2ForCausalLM-17aca0b86879": ("Qwen2ForCausalLM", 1.4e-16),
    "Qwen3ForCausalLM-20988a8414c4": ("Qwen3ForCausalLM", 1.4e-16),
    "Qwen3ForCausalLM-50aec18e0f23": ("Qwen3ForCausalLM", 1.4e-16),
    "Qwen3MoeForCausalLM-bc046ae848de": ("Qwen3MoeForCausalLM", 1.4e-16),
    "SmolLM3ForCausalLM-545adeab47ab": ("SmolLM3ForCausalLM", 1.4e-16),
}
