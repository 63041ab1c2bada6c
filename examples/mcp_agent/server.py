"""A small MCP server over stdio with two tools: ``add`` (a calculator) and ``capital`` (a lookup table).

    python examples/mcp_agent/server.py      # speaks MCP on stdin/stdout; the agent starts it itself
"""

from mcp.server.mcpserver import MCPServer

CAPITALS = {
    "afghanistan": "Kabul", "albania": "Tirana", "algeria": "Algiers", "angola": "Luanda", "armenia": "Yerevan",
    "austria": "Vienna", "azerbaijan": "Baku", "bangladesh": "Dhaka", "belarus": "Minsk", "belgium": "Brussels",
    "bhutan": "Thimphu", "bolivia": "Sucre", "botswana": "Gaborone", "bulgaria": "Sofia", "burundi": "Gitega",
    "cambodia": "Phnom Penh", "chad": "N'Djamena", "chile": "Santiago", "colombia": "Bogota", "croatia": "Zagreb",
    "cuba": "Havana", "cyprus": "Nicosia", "denmark": "Copenhagen", "ecuador": "Quito", "egypt": "Cairo",
    "eritrea": "Asmara", "estonia": "Tallinn", "ethiopia": "Addis Ababa", "fiji": "Suva", "finland": "Helsinki",
    "france": "Paris", "gabon": "Libreville", "georgia": "Tbilisi", "ghana": "Accra", "greece": "Athens",
    "guatemala": "Guatemala City", "guinea": "Conakry", "guyana": "Georgetown", "haiti": "Port-au-Prince",
    "honduras": "Tegucigalpa", "hungary": "Budapest", "iceland": "Reykjavik", "indonesia": "Jakarta",
    "iran": "Tehran", "iraq": "Baghdad", "ireland": "Dublin", "italy": "Rome", "jamaica": "Kingston",
    "japan": "Tokyo", "jordan": "Amman", "kenya": "Nairobi", "kuwait": "Kuwait City", "laos": "Vientiane",
    "latvia": "Riga", "lebanon": "Beirut", "liberia": "Monrovia", "libya": "Tripoli", "lithuania": "Vilnius",
    "madagascar": "Antananarivo", "malawi": "Lilongwe", "mali": "Bamako", "malta": "Valletta",
    "mauritania": "Nouakchott", "moldova": "Chisinau", "mongolia": "Ulaanbaatar", "morocco": "Rabat",
    "mozambique": "Maputo", "namibia": "Windhoek", "nepal": "Kathmandu", "nicaragua": "Managua",
    "niger": "Niamey", "norway": "Oslo", "oman": "Muscat", "panama": "Panama City", "paraguay": "Asuncion",
    "peru": "Lima", "poland": "Warsaw", "portugal": "Lisbon", "qatar": "Doha", "romania": "Bucharest",
    "rwanda": "Kigali", "senegal": "Dakar", "serbia": "Belgrade", "slovakia": "Bratislava",
    "slovenia": "Ljubljana", "somalia": "Mogadishu", "sudan": "Khartoum", "suriname": "Paramaribo",
    "sweden": "Stockholm", "syria": "Damascus", "tajikistan": "Dushanbe", "thailand": "Bangkok",
    "togo": "Lome", "tunisia": "Tunis", "uganda": "Kampala", "ukraine": "Kyiv", "uruguay": "Montevideo",
    "uzbekistan": "Tashkent", "venezuela": "Caracas", "vietnam": "Hanoi", "yemen": "Sanaa", "zambia": "Lusaka",
    "zimbabwe": "Harare",
}  # fmt: skip

server = MCPServer("tracegym-example-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def capital(country: str) -> str:
    """The capital city of a country (a lookup table)."""
    return CAPITALS.get(country.strip().lower(), f"unknown country: {country}")


if __name__ == "__main__":
    server.run("stdio")
