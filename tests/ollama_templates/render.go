// Renders Ollama's Go chat templates as Ollama's server does, for tests/test_presets.py: reads
// {"templates": {name: text}, "conversations": [[{role, content}]]} on stdin and writes
// {name: [text per conversation]} on stdout.
//
//	go run render.go < cases.json > expected.json
//
// A template that reads .Messages gets the collated conversation at once; an older one
// (.System/.Prompt/.Response) runs once per turn, the last turn cut after .Response.
package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"text/template"
	"text/template/parse"
)

type Message struct {
	Role      string `json:"role"`
	Content   string `json:"content"`
	Thinking  string `json:"thinking"`
	ToolName  string `json:"tool_name"`
	ToolCalls []any  `json:"tool_calls"`
}

type Input struct {
	Templates     map[string]string `json:"templates"`
	Conversations [][]Message       `json:"conversations"`
}

var funcs = template.FuncMap{"json": func(v any) string { b, _ := json.Marshal(v); return string(b) }}

func values(system, prompt, response string) map[string]any {
	return map[string]any{"System": system, "Prompt": prompt, "Response": response, "Think": false, "IsThinkSet": false}
}

// gather joins the system messages, and merges each message into the previous one of its role.
func gather(msgs []Message) (string, []*Message) {
	var system []string
	var out []*Message
	for i := range msgs {
		m := msgs[i]
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if n := len(out); n > 0 && out[n-1].Role == m.Role && m.Role != "tool" {
			out[n-1].Content += "\n\n" + m.Content
		} else {
			out = append(out, &m)
		}
	}
	return strings.Join(system, "\n\n"), out
}

// readsResponse says whether a pipe reads .Response.
func readsResponse(p *parse.PipeNode) bool {
	return p != nil && strings.Contains(p.String(), ".Response")
}

// cutAfterResponse drops every node after the first one that reads .Response.
func cutAfterResponse(list *parse.ListNode, cut *bool) {
	if list == nil {
		return
	}
	var kept []parse.Node
	for _, n := range list.Nodes {
		if *cut {
			continue
		}
		kept = append(kept, n)
		switch t := n.(type) {
		case *parse.ActionNode:
			*cut = readsResponse(t.Pipe)
		case *parse.IfNode:
			*cut = readsResponse(t.Pipe)
			cutAfterResponse(t.List, cut)
			cutAfterResponse(t.ElseList, cut)
		case *parse.RangeNode:
			*cut = readsResponse(t.Pipe)
			cutAfterResponse(t.List, cut)
			cutAfterResponse(t.ElseList, cut)
		}
	}
	list.Nodes = kept
}

func render(text string, conv []Message) string {
	t := template.Must(template.New("").Funcs(funcs).Parse(text))
	system, msgs := gather(conv)
	var b bytes.Buffer
	if strings.Contains(text, ".Messages") {
		v := values(system, "", "")
		v["Messages"] = msgs
		v["Tools"] = nil
		if err := t.Execute(&b, v); err != nil {
			panic(err)
		}
		return b.String()
	}
	system = ""
	prompt, response := "", ""
	turn := func() {
		if err := t.Execute(&b, values(system, prompt, response)); err != nil {
			panic(err)
		}
		system, prompt, response = "", "", ""
	}
	for _, m := range msgs {
		switch m.Role {
		case "system":
			if prompt != "" || response != "" {
				turn()
			}
			system = m.Content
		case "user":
			if response != "" {
				turn()
			}
			prompt = m.Content
		case "assistant":
			response = m.Content
		}
	}
	last := template.Must(template.New("").Funcs(funcs).Parse(text))
	cut := false
	cutAfterResponse(last.Tree.Root, &cut)
	if err := last.Execute(&b, values(system, prompt, response)); err != nil {
		panic(err)
	}
	return b.String()
}

func main() {
	var in Input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	out := map[string][]string{}
	for name, text := range in.Templates {
		for _, conv := range in.Conversations {
			out[name] = append(out[name], render(text, conv))
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(out); err != nil {
		panic(err)
	}
}
