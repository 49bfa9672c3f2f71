/* opfuse fusion report, part 1 of 5 (common.js): error marker, helpers, the data. The report's script is
 * common.js, graph.js, details.js, roofline.js, tables.js joined in that order inside one function
 * (opfuse/analysis/report.py does it), so they share these names. Everything is built with DOM calls and
 * textContent (never innerHTML), so names from the model cannot inject markup. When drawing is done an element
 * #report-rendered is added; any script error adds #report-error instead. */

  var started = performance.now();

  function showError(message) {
    if (document.getElementById("report-error")) return;
    var box = document.createElement("div");
    box.id = "report-error";
    box.textContent = "The report script failed: " + message;
    document.body.insertBefore(box, document.body.firstChild);
  }
  window.addEventListener("error", function (event) { showError(event.message || String(event.error)); });

  // ---- helpers ------------------------------------------------------------------------------------------
  var SVG_NS = document.getElementById("graph-svg").namespaceURI;   // the parser's SVG namespace
  var KIND_COLORS = {
    "anchor+epilogue": "#4e79a7", "residual": "#9c6ade", "horizontal": "#f28e2b",
    "horizontal pointwise": "#d4b000", "conv-conv": "#59a14f", "pointwise": "#59a8a2",
    "reduction": "#e377c2", "squeeze": "#ff9da7", "injective": "#b07a4f", "single": "#8c8c8c", "opaque": "#d62728", "view": "#c8c8c8"
  };

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    for (var key in attrs || {}) node.setAttribute(key, attrs[key]);
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }
  function svg(tag, attrs, text) {
    var node = document.createElementNS(SVG_NS, tag);
    for (var key in attrs || {}) node.setAttribute(key, attrs[key]);
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function scaled(n, units) {
    for (var i = 0; i < units.length; i++) if (Math.abs(n) >= units[i][1]) return (n / units[i][1]).toFixed(2) + " " + units[i][0];
    return null;
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) return "-";
    return scaled(n, [["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) || Math.round(n) + " B";
  }
  function fmtFlops(n) {
    return scaled(n, [["TFLOP", 1e12], ["GFLOP", 1e9], ["MFLOP", 1e6], ["KFLOP", 1e3]]) || Math.round(n) + " FLOP";
  }
  function fmtRate(n) {
    return scaled(n, [["PFLOP/s", 1e15], ["TFLOP/s", 1e12], ["GFLOP/s", 1e9], ["MFLOP/s", 1e6]]) || n.toFixed(0) + " FLOP/s";
  }
  function fmtTime(s) {
    if (s === null || s === undefined) return "-";
    return s >= 1e-3 ? (s * 1e3).toFixed(3) + " ms" : (s * 1e6).toFixed(1) + " µs";
  }
  function fmtValue(v, unit) {
    if (v === null || v === undefined) return "-";
    if (unit === "bytes") return fmtBytes(v);
    if (unit === "seconds") return fmtTime(v);
    if (unit === "density") return v.toFixed(1);
    return String(v);
  }
  function change(before, after) {
    if (before === null || before === undefined || after === null || after === undefined || !before) return "-";
    var pct = (after - before) / before * 100;
    return (pct > 0 ? "+" : "") + pct.toFixed(1) + "%";
  }
  function truncate(text, n) { return text.length > n ? text.slice(0, n - 1) + "…" : text; }
  function kindColor(kind) { return KIND_COLORS[kind] || "#8c8c8c"; }
  function kindClass(text) { return String(text).replace(/[^a-z0-9]+/gi, "-").toLowerCase(); }

  var data = JSON.parse(document.getElementById("report-data").textContent);
  var A = data.analysis;
  var G = data.graph;
  var groupsByName = {};
  A.plan.groups.forEach(function (g) { groupsByName[g.name] = g; });
  var nodeIndex = {};
  G.nodes.forEach(function (n, i) { nodeIndex[n.name] = i; });
