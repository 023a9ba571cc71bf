"""Clients of servers outside rlstream, shared by the stages that call them:
:mod:`rlstream.clients.openai_http` (an OpenAI-compatible completions endpoint, used by the
producers' ``openai`` backend and the teacher annotator)."""
