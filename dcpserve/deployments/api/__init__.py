"""The OpenAI surface of the app: the HTTP edge (keys, body limit, errors), the request bodies and their validation,
the OpenAIIngress deployment, and the response side of a request (choices, logprobs, tool calls, structured
outputs)."""
