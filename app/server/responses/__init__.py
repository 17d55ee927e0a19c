"""OpenAI's Responses API: its schemas, the chat request a conversation stands for, its
responder (the Response object, or its typed events), the store that previous_response_id
reads, and its routes."""
