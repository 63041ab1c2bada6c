"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) as a thin translation to the
gateway's one chat call: ``items`` (input items ⇄ chat messages, output items of a ``Turn``), ``request``
(the body → a ``ParsedRequest``), ``chain`` (``previous_response_id`` and stored responses, read from the
trace store), ``body`` (the Response object), ``stream`` (the event grammar), ``responses_routes``."""
