"""Anthropic's Messages API: its schemas, the chat request a Messages body stands for, its
responder (the message, or its typed events) and its routes."""
