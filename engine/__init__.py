"""The runtime the stages drive: target model, KV cache, sampling, generation, weight loading."""
