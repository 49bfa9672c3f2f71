/* part 3 (details.js): the details panel, selection (click, hover, #g3 in the address), collapsing, search. */

  // ---- details panel ---------------------------------------------------------------------------------------
  function detailTable(rows, head) {
    var table = el("table");
    if (head) { var tr = el("tr"); head.forEach(function (h) { tr.appendChild(el("th", {}, h)); }); table.appendChild(tr); }
    rows.forEach(function (row) {
      var tr = el("tr");
      row.forEach(function (cell, i) { tr.appendChild(el("td", i ? {"class": "num"} : {}, cell)); });
      table.appendChild(tr);
    });
    return table;
  }

  function verdictBadge(verdict) { return el("span", {"class": "verdict verdict-" + kindClass(verdict)}, verdict); }

  function showGroup(name) {
    var group = groupsByName[name], extra = data.groups[name], panel = clear(document.getElementById("details"));
    var title = el("h3");
    title.appendChild(el("span", {"class": "swatch", style: "background:" + kindColor(group.kind) + ";margin-left:0"}));
    title.appendChild(document.createTextNode(group.name + " · " + group.kind + (group.launches ? "" : " (no kernel)")));
    panel.appendChild(title);
    panel.appendChild(el("p", {"class": "reason"}, group.reason || "-"));
    panel.appendChild(el("b", {}, "Ops (" + group.nodes.length + ")"));
    var list = el("ul");
    group.nodes.forEach(function (n) {
      var node = G.nodes[nodeIndex[n]];
      var text = n + " [" + (node ? node.op : "?") + "] " + (node ? node.type : "") + (node && node.target ? " " + node.target : "");
      list.appendChild(el("li", n === group.anchor ? {"class": "anchor"} : {}, text + (n === group.anchor ? " (anchor)" : "")));
    });
    panel.appendChild(list);
    if (group.launches) {
      var b = extra.before, m = extra.measured || {};
      panel.appendChild(el("b", {}, "Before and after fusion"));
      var rows = [
        ["kernel launches", String(b.launches), String(group.launches)],
        ["bytes read", fmtBytes(b.bytes_read), fmtBytes(group.bytes_read)],
        ["bytes written", fmtBytes(b.bytes_written), fmtBytes(group.bytes_written)],
        ["total traffic", fmtBytes(b.bytes_read + b.bytes_written), fmtBytes(group.bytes_read + group.bytes_written)],
        ["FLOPs", fmtFlops(b.flops), fmtFlops(group.flops)],
        ["predicted time", fmtTime(b.predicted_time), fmtTime(group.predicted_time)]
      ];
      if (m.time) rows.push(["measured time", "-", fmtTime(m.time)]);
      panel.appendChild(detailTable(rows, ["", "ops apart", "fused"]));
      var r = group.resources;
      if (r) {
        panel.appendChild(el("b", {}, "Resources (estimate" + (extra.measured ? " vs measured" : "") + ")"));
        var tile = Object.keys(r.tile).map(function (k) { return k + "=" + r.tile[k]; }).join(" ");
        var config = m.config === undefined ? "-" : typeof m.config === "object" ? JSON.stringify(m.config) : String(m.config);
        var res = [["tile", tile, config],
          ["registers / thread", String(r.registers_per_thread), m.registers !== undefined ? String(m.registers) : "-"],
          ["shared memory", fmtBytes(r.shared_memory_bytes), m.shared_memory !== undefined ? fmtBytes(m.shared_memory) : "-"],
          ["spills", "-", m.spills !== undefined ? String(m.spills) : "-"],
          ["fits the hardware", r.fits ? "yes" : "no: " + r.reason, ""]];
        panel.appendChild(detailTable(res, ["", "estimate", "measured"]));
      }
    }
    var decisions = extra.decisions.map(function (i) { return A.plan.decisions[i]; });
    if (decisions.length) {
      panel.appendChild(el("b", {}, "Fusion decisions touching it (" + decisions.length + ")"));
      var ul = el("ul");
      decisions.forEach(function (d) {
        var li = el("li");
        li.appendChild(verdictBadge(d.verdict));
        li.appendChild(document.createTextNode(" " + d.fusion + ": " + d.producer.join(", ") + " → " +
          d.consumer.join(", ") + ": " + d.reason));
        ul.appendChild(li);
      });
      panel.appendChild(ul);
    }
  }

  function showOverview() {
    var panel = clear(document.getElementById("details"));
    panel.appendChild(el("p", {"class": "hint"}, "Hover over a fusion group (a coloured box) to see its ops, why it was " +
      "fused and what it costs before and after; click it to keep it here (Esc releases it). The small square on a " +
      "box collapses it."));
    var ranked = A.plan.groups.filter(function (g) { return g.launches; }).map(function (g) {
      var b = data.groups[g.name].before;
      return {group: g, saved: b.bytes_read + b.bytes_written - g.bytes_read - g.bytes_written};
    }).filter(function (r) { return r.saved > 0; }).sort(function (a, b) { return b.saved - a.saved; }).slice(0, 8);
    if (!ranked.length) return;
    panel.appendChild(el("b", {}, "Largest traffic savings"));
    var ul = el("ul", {"class": "overview"});
    ranked.forEach(function (r) {
      var li = el("li", {"class": "clickable", "data-pick": r.group.name}, r.group.name + " (" + r.group.kind + ", " +
        r.group.nodes.length + " ops): " + fmtBytes(r.saved) + " less");
      ul.appendChild(li);
    });
    ul.addEventListener("click", function (event) {
      var hit = event.target.closest("[data-pick]");
      if (hit) select(hit.getAttribute("data-pick"), true);
    });
    panel.appendChild(ul);
  }

  function showNode(i) {
    var node = G.nodes[i], panel = clear(document.getElementById("details"));
    panel.appendChild(el("h3", {}, node.name + " [" + node.op + "]"));
    panel.appendChild(el("p", {}, node.op === "input" ? "graph input " + node.type : node.type));
  }

  function select(name, scroll) {
    selected = name;
    if (name) showGroup(name);
    markSelected();
    if (name && scroll) scrollToGroup(name);
  }

  function markSelected() {
    document.querySelectorAll("svg.graph .group.selected, svg.roofline .selected, table.list tr.selected").forEach(function (e) {
      e.classList.remove("selected");
    });
    if (!selected) return;
    document.querySelectorAll('[data-group="' + CSS.escape(selected) + '"]').forEach(function (e) {
      if (e.classList.contains("group") || e.classList.contains("pt-group") || e.tagName === "TR") e.classList.add("selected");
    });
  }

  function scrollToGroup(name) {
    var block = G.blocks.filter(function (b) { return b.group === name; })[0];
    if (!block) return;
    var pos = blockPos[block.id], box = document.getElementById("graph-container");
    box.scrollTo({left: Math.max(0, pos.x - 40), top: Math.max(0, pos.y - 40)});
    document.getElementById("graph-section").scrollIntoView();
  }

  function graphEvents() {
    var root = document.getElementById("graph-svg");
    root.addEventListener("click", function (event) {
      var toggle = event.target.closest("[data-toggle]");
      if (toggle) {
        var id = toggle.getAttribute("data-toggle");
        collapsed[id] = !collapsed[id];
        drawGraph();
        return;
      }
      var hit = event.target.closest("[data-group]");
      if (hit) { select(hit.getAttribute("data-group"), false); return; }
      var node = event.target.closest("[data-node]");
      if (node) { selected = null; markSelected(); showNode(nodeIndex[node.getAttribute("data-node")]); }
    });
    root.addEventListener("mouseover", function (event) {
      if (selected) return;
      var hit = event.target.closest("[data-group]");
      if (hit) showGroup(hit.getAttribute("data-group"));
    });
    document.addEventListener("keydown", function (event) {
      if (event.key === "Escape") { selected = null; markSelected(); showOverview(); }
    });
    document.getElementById("collapse-all").addEventListener("click", function () {
      G.blocks.forEach(function (b) { if (isBoxed(b) && b.rows.length + b.rows[0].length > 2) collapsed[b.id] = true; });
      drawGraph();
    });
    document.getElementById("expand-all").addEventListener("click", function () { collapsed = {}; drawGraph(); });
    var search = document.getElementById("search");
    search.addEventListener("input", function () { searchTerm = search.value.trim().toLowerCase(); applySearch(); });
    search.addEventListener("keydown", function (event) {
      if (event.key !== "Enter" || !searchTerm) return;
      var first = A.plan.groups.filter(groupMatches)[0];
      if (first) select(first.name, true);
    });
  }

  function selectFromHash() {   // report.html#g3 opens with group g3 selected
    var wanted = decodeURIComponent(location.hash.slice(1));
    if (groupsByName.hasOwnProperty(wanted)) select(wanted, true);
  }

  // ---- search -------------------------------------------------------------------------------------------------
  function nodeMatches(node) {
    return (node.name + " " + node.op + " " + node.source + " " + node.target).toLowerCase().indexOf(searchTerm) >= 0;
  }
  function groupMatches(group) {
    if ((group.name + " " + group.kind).toLowerCase().indexOf(searchTerm) >= 0) return true;
    return group.nodes.some(function (n) {
      var node = G.nodes[nodeIndex[n]];
      return node ? nodeMatches(node) : n.indexOf(searchTerm) >= 0;
    });
  }

  function applySearch() {
    var active = searchTerm.length > 0, groupHits = {}, nodeHits = 0;
    A.plan.groups.forEach(function (g) { groupHits[g.name] = !active || groupMatches(g); });
    document.querySelectorAll("svg.graph .node").forEach(function (e) {
      var node = G.nodes[nodeIndex[e.getAttribute("data-node")]], hit = active && nodeMatches(node);
      if (hit) nodeHits++;
      e.classList.toggle("match", hit);
      e.classList.toggle("dim", active && !hit && !(node.group && groupHits[node.group]));
    });
    document.querySelectorAll("svg.graph .group").forEach(function (e) {
      e.classList.toggle("dim", !groupHits[e.getAttribute("data-group")]);
    });
    document.querySelectorAll("svg.roofline .pt-group[data-group]").forEach(function (e) {
      e.classList.toggle("dim", !groupHits[e.getAttribute("data-group")]);
    });
    document.querySelectorAll("#groups-table tr[data-group]").forEach(function (tr) {
      tr.style.display = groupHits[tr.getAttribute("data-group")] ? "" : "none";
    });
    document.querySelectorAll("#refused-table tr[data-text]").forEach(function (tr) {
      tr.style.display = !active || tr.getAttribute("data-text").indexOf(searchTerm) >= 0 ? "" : "none";
    });
    var count = A.plan.groups.filter(function (g) { return groupHits[g.name]; }).length;
    document.getElementById("search-count").textContent = active ? nodeHits + " ops, " + count + " groups match" : "";
  }

  function renderLegend() {
    var legend = document.getElementById("legend"), used = {};
    A.plan.groups.forEach(function (g) { used[g.kind] = (used[g.kind] || 0) + 1; });
    legend.appendChild(document.createTextNode("Fusion kinds:"));
    Object.keys(used).sort().forEach(function (kind) {
      legend.appendChild(el("span", {"class": "swatch", style: "background:" + kindColor(kind)}));
      legend.appendChild(document.createTextNode(kind + " (" + used[kind] + ")"));
    });
    legend.appendChild(document.createTextNode(" · red op: runs through PyTorch · dashed grey op: view (no kernel)"));
  }
