"""What the kvwatch-vllm tests build vLLM objects with: the only stand-in is the model (its
tokens come from `tokens.next_token`), everything else is vLLM's own."""
