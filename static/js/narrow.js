// Plots on a narrow screen (wrapped titles, automargins); app/server/narrow.py NARROW_JS says what and why.
() => {
  if (window.lmscopeNarrow) return [];
  window.lmscopeNarrow = true;
  const plain = (s) => s.replace(/<[^>]*>/g, '');
  const wrapWords = (text, n) => {
    const out = []; let line = '';
    for (const w of text.split(' ')) {
      if (line && (line + ' ' + w).length > n) { out.push(line); line = w; } else line = line ? line + ' ' + w : w;
    }
    if (line) out.push(line);
    return out;
  };
  const wrapTitle = (text, n) => {
    const lines = [];
    for (const line of text.split(/<br\s*\/?>/i)) {
      const m = line.match(/^<(\w+)([^>]*)>([^<]*)<\/\1>$/);
      if (m) { const k = /^su[bp]$/i.test(m[1]) ? 1.4 : 1;
               for (const part of wrapWords(m[3], Math.floor(n * k))) lines.push('<' + m[1] + m[2] + '>' + part + '</' + m[1] + '>'); }
      else if (!line.includes('<')) lines.push(...wrapWords(line, n));
      else lines.push(line);
    }
    return lines;
  };
  const fit = (gd) => {
    const fl = gd._fullLayout;
    if (!fl || !window.Plotly || !gd.offsetWidth) return;
    const W = fl.width, upd = {};
    if (gd.lmscopeLayout && gd.lmscopeLayout !== gd.layout) gd.lmscopeLegend = gd.lmscopeLegendOf = gd.lmscopeCells = undefined;
    const title = gd.layout && gd.layout.title;
    const text = title && (typeof title === 'string' ? title : title.text);
    const t = gd.querySelector('.gtitle');
    if (text && t && gd.lmscopeTitle !== text) {
      const r = t.getBoundingClientRect(), g = gd.getBoundingClientRect();
      if (r.right > g.left + W - 2) {
        const size = (fl.title && fl.title.font && fl.title.font.size) || 14;
        const lines = wrapTitle(text, Math.max(16, Math.floor((W - 20) / (size * 0.56))));
        const wrapped = lines.join('<br>');
        const added = lines.length - text.split(/<br\s*\/?>/i).length;
        upd['title.text'] = wrapped;
        if (added > 0) upd['margin.t'] = fl.margin.t + Math.ceil(added * size * 1.3);
        gd.lmscopeTitle = wrapped;
      } else gd.lmscopeTitle = text;
    }
    for (const k of Object.keys(fl)) {
      if (/^[xy]axis\d*$/.test(k) && fl[k] && fl[k].visible !== false && !fl[k].automargin) upd[k + '.automargin'] = true;
    }
    const notes = [...gd.querySelectorAll('.annotation')];
    const texts = (fl.annotations || []).map(a => a.text).join('|');
    if (notes.length === 1 && gd.lmscopeNotes !== texts) {  // a message wider than the plot: more lines
      const a = fl.annotations[0], r = notes[0].getBoundingClientRect();
      if (a && a.text && !a.text.includes('<') && r.width > W - 16) {
        const size = (a.font && a.font.size) || 12;
        upd['annotations[0].text'] = wrapWords(a.text, Math.max(12, Math.floor((W - 24) / (size * 0.56)))).join('<br>');
        gd.lmscopeNotes = upd['annotations[0].text'];
      } else gd.lmscopeNotes = texts;
    }
    if (notes.length > 1 && gd.lmscopeNotes !== texts) {
      const boxes = notes.map(n => n.getBoundingClientRect());
      let overlap = false;
      for (let i = 0; i < boxes.length && !overlap; i++) for (let j = i + 1; j < boxes.length; j++) {
        const a = boxes[i], b = boxes[j];
        if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom) { overlap = true; break; }
      }
      // side-by-side subplot titles that run into each other: their first part, smaller, and wrapped to
      // their own share of the width (the top margin grows by the lines added)
      let added = 0;
      if (overlap) (fl.annotations || []).forEach((a, i) => {
        if (!a.text) return;
        const short = plain(a.text).split(' · ')[0].replace(/head (\d+)/, 'h$1');
        // each title's share of the plotting area (the margins, grown for axis labels, are not theirs)
        const area = (fl._size && fl._size.w) || W;
        const lines = wrapWords(short, Math.max(10, Math.floor((area / notes.length - 12) / (10 * 0.56))));
        added = Math.max(added, lines.length - 1);
        upd['annotations[' + i + '].text'] = lines.join('<br>');
        upd['annotations[' + i + '].font.size'] = 10;
      });
      if (added > 0) upd['margin.t'] = (upd['margin.t'] || fl.margin.t) + added * 13;
      gd.lmscopeNotes = overlap ? (fl.annotations || []).map((a, i) => upd['annotations[' + i + '].text'] || a.text).join('|') : texts;
    }
    // Side-by-side subplots: a right-hand subplot's y tick labels that reach into the subplot left of
    // it (a narrow page leaves the gap narrower than the labels) are dropped; its hover names each bar.
    for (const k of Object.keys(fl)) {
      if (!/^yaxis\d+$/.test(k) || !fl[k] || fl[k].showticklabels === false || !fl[k].anchor) continue;
      const xa = fl[fl[k].anchor.replace('x', 'xaxis')];
      if (!xa || xa._offset === undefined) continue;
      const ends = Object.keys(fl).filter(j => /^xaxis\d*$/.test(j) && fl[j] && fl[j]._offset !== undefined
                                           && fl[j]._offset + fl[j]._length <= xa._offset + 1)
                                  .map(j => fl[j]._offset + fl[j]._length);
      if (!ends.length) continue;
      const left = gd.getBoundingClientRect().left, end = Math.max(...ends);
      const labels = [...gd.querySelectorAll('.' + k.replace('axis', '') + 'tick text')].map(n => n.getBoundingClientRect());
      if (labels.some(b => b.width && b.left - left < end)) upd[k + '.showticklabels'] = false;
    }
    // A legend that crowds the plot (Plotly makes room for one placed beside it by shrinking the plot): a
    // row above the plot, smaller; still more than a quarter of the figure's height: off (hover says it).
    const lg = gd.querySelector('.legend');
    if (fl.showlegend && lg && gd.lmscopeLegend !== 'off' && gd.lmscopeLegendOf !== gd.layout) {
      const r = lg.getBoundingClientRect(), H = fl.height;
      if (gd.lmscopeLegend === 'moved') {
        if (r.height > H / 4 || fl._size.w < 0.6 * W) { upd.showlegend = false; gd.lmscopeLegend = 'off'; }
        gd.lmscopeLegendOf = gd.layout;
      } else if (r.height > H / 4 || r.width > fl._size.w + 4 || fl._size.w < 0.6 * W) {
        Object.assign(upd, {'legend.orientation': 'h', 'legend.x': 0, 'legend.xanchor': 'left', 'legend.y': 1,
                            'legend.yanchor': 'bottom', 'legend.font.size': 10});
        gd.lmscopeLegend = 'moved';
      } else gd.lmscopeLegendOf = gd.layout;
    }
    // Text in heatmap cells (the logit lens's top tokens) that would run into the next cell: smaller,
    // down to 7 px, else none (the cell's hover still names it).
    (gd._fullData || []).forEach((t, i) => {
      if (t.type !== 'heatmap' || !t.texttemplate || !Array.isArray(t.text) || !t.xaxis) return;
      const xa = fl[t.xaxis.replace('x', 'xaxis')], cols = (t.z && t.z[0] && t.z[0].length) || 1;
      if (!xa || !xa._length) return;
      const longest = t.text.flat().reduce((m, s) => Math.max(m, String(s == null ? '' : s).length), 1);
      const size = (t.textfont && t.textfont.size) || 12, fits = Math.floor((xa._length / cols - 2) / (longest * 0.6));
      if (fits >= size) return;
      const was = gd.lmscopeCells || (gd.lmscopeCells = {});
      if (!(i in was)) was[i] = {texttemplate: gd.data[i].texttemplate, 'textfont.size': size};
      const d = fits >= 7 ? {'textfont.size': fits} : {texttemplate: ''};
      window.Plotly.restyle(gd, d, [i]);
      gd.lmscopeLayout = gd.layout;
    });
    if (Object.keys(upd).length) {
      // what a wide window gets back (see `restore`): the first value of each text, size and margin changed
      const was = {};
      for (const k of Object.keys(upd)) {
        if (k === 'title.text') was[k] = text;
        else if (k === 'margin.t') was[k] = fl.margin.t;
        else if (k === 'showlegend') was[k] = gd.layout.showlegend === undefined ? null : gd.layout.showlegend;
        else if (k.startsWith('legend.')) {
          const v = k.split('.').slice(1).reduce((o, p) => (o == null ? undefined : o[p]), gd.layout.legend);
          was[k] = v === undefined ? null : v;
        }
        else if (/^yaxis\d+\.showticklabels$/.test(k)) was[k] = true;
        else { const m = k.match(/^annotations\[(\d+)\]\.(text|font\.size)$/);
               if (m) { const a = (gd.layout.annotations || [])[+m[1]] || {};
                        was[k] = m[2] === 'text' ? a.text : ((a.font && a.font.size) || null); } }
      }
      gd.lmscopeWas = Object.assign(was, gd.lmscopeLayout === gd.layout ? gd.lmscopeWas : {});
      window.Plotly.relayout(gd, upd);
      gd.lmscopeLayout = gd.layout;
    }
  };
  // Wide again (a phone turned, a window widened): a figure keeps the titles it was drawn with. Only
  // while it still has the layout this script changed: a figure Gradio drew since is new.
  const restore = (gd) => {
    if (!gd.lmscopeWas && !gd.lmscopeCells && !gd.lmscopeLegend) return;
    if (gd.lmscopeLayout === gd.layout) {
      for (const [i, d] of Object.entries(gd.lmscopeCells || {})) window.Plotly.restyle(gd, d, [+i]);
      if (gd.lmscopeWas) window.Plotly.relayout(gd, gd.lmscopeWas);
    }
    gd.lmscopeWas = gd.lmscopeLayout = gd.lmscopeNotes = gd.lmscopeTitle = undefined;
    gd.lmscopeCells = gd.lmscopeLegend = gd.lmscopeLegendOf = undefined;
  };
  // The selected tab in view in a tab row that scrolls sideways (static/lmscope.css), once per change.
  let shownTab = null;
  const showTab = () => {
    const b = document.querySelector('#tabs [role="tablist"] button[aria-selected="true"]');
    if (!b || b === shownTab) return;
    shownTab = b;
    const row = b.parentElement, r = b.getBoundingClientRect(), w = row.getBoundingClientRect();
    if (r.left < w.left || r.right > w.right) row.scrollLeft += r.left - w.left - 8;
  };
  setInterval(() => {
    const wide = window.innerWidth >= 900;
    try { showTab(); } catch (e) {}
    for (const gd of document.querySelectorAll('.js-plotly-plot')) { try { wide ? restore(gd) : fit(gd); } catch (e) {} }
  }, 400);
  return [];
}
