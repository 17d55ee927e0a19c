"""Muse Glimmer's calls: XML invocations whose tags begin atem:, in a function_calls block
(invoke_xml.py)."""

from app.server.tools.invoke_xml import InvokeXml


class Glimmer(InvokeXml):
    name = "glimmer"
    prefix = "atem:"
    opener, closer = "<atem:function_calls>", "</atem:function_calls>"
    markers = (opener, closer)
