"""The HTTP layer in front of the handlers (docs/architecture.md, "The HTTP layer"):

- fastpath: the enqueue and read fast path on llhttp (httptools), the protocol every
  connection starts on;
- serving: aiohttp's server and protocol hardened for hostile clients, the connection guard;
- memguard: the per-process memory guard (refuse new work near the RSS ceiling);
- logsafe: log hygiene (no request bytes in any log line);
- parse_errors: what aiohttp's parser refused, as fixed texts.
"""
