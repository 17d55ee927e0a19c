"""MiniMax M2's calls: XML invocations in a <minimax:tool_call> block (invoke_xml.py)."""

from app.server.tools.invoke_xml import InvokeXml


class MiniMaxM2(InvokeXml):
    name = "minimax_m2"
    opener, closer = "<minimax:tool_call>", "</minimax:tool_call>"
    markers = (opener, closer)
