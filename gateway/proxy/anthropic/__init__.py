"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a thin translation
to the gateway's one chat call: ``request`` (system, content blocks and tools → chat messages), ``body``
(the Message object), ``stream`` (the Messages event grammar), ``anthropic_errors`` (Anthropic's error shape),
``messages_routes``."""
