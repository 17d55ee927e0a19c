"""MiniCPM 5's calls: a function tag naming the function, a param tag a parameter, a value
typed by the tool's schema (invoke_xml.py):

    <function name="get_weather"><param name="city">Paris</param></function>
"""

from app.server.tools.invoke_xml import InvokeXml


class MiniCpm(InvokeXml):
    name = "minicpm"
    invoke, parameter = "function", "param"
    wrapped = False
    opener, closer = '<function name="', "</function>"
    markers = (opener, closer)
