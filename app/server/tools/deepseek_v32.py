"""DeepSeek V3.2's calls, and V4's: DSML, XML invocations whose tags begin ｜DSML｜, each
parameter saying whether its value is text (invoke_xml.py), in a function_calls block (V3.2)
or a tool_calls block (V4):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>
"""

from app.server.tools.invoke_xml import InvokeXml

DSML = "｜DSML｜"


class DeepSeekV32(InvokeXml):
    name = "deepseek_v32"
    prefix = DSML
    string_attribute = True
    opener, closer = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
    markers = (opener, closer)


class DeepSeekV4(DeepSeekV32):
    name = "deepseek_v4"
    opener, closer = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
    markers = (opener, closer)
