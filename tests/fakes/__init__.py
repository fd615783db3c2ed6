"""Fakes of the outside world (LLM, chat platforms) as real servers on 127.0.0.1."""
