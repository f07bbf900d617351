"""What runs inside vLLM: the stream-fused model classes and the stream attention."""
